"""Bidirectional attention within each whole prompt of a step, for the models that keep no KV
cache (BERT encoders, EmbeddingGemma's bidirectional Gemma 3): every token sees every other
token of its own prompt, or, on a sliding layer, those within `window` positions either side.

The step's prompts are grouped by length, each group padded to its longest (at most a third
longer than its shortest) with padded keys masked: one padded batch of prompts of 20 and 200
tokens took 3x the attention's work; one call per prompt was slow in bf16. Built once a step,
used by every layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class PromptGroups:
    def __init__(self, seq_lens: list[int], device: torch.device) -> None:
        starts = [0]
        for n in seq_lens:
            starts.append(starts[-1] + n)
        groups: list[list[int]] = []
        for i in sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i]):
            if groups and 4 * seq_lens[i] >= 3 * seq_lens[groups[-1][0]]:
                groups[-1].append(i)
            else:
                groups.append([i])
        as_tensor = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
        # Each group: (prompts, longest, flat rows gathered, the valid rows of the padded
        # output, their flat rows, the key mask (None: none padded)). A padding slot gathers
        # row 0: as a key it is masked, as a query its output is dropped.
        self.parts = []
        self._windowed: dict[tuple[int, int], torch.Tensor] = {}
        for group in groups:
            longest = seq_lens[group[0]]
            gather, valid, rows = [], [], []
            for j, i in enumerate(group):
                n, start = seq_lens[i], starts[i]
                gather += [*range(start, start + n), *[0] * (longest - n)]
                valid += range(j * longest, j * longest + n)
                rows += range(start, start + n)
            mask = None
            if any(seq_lens[i] != longest for i in group):
                lens = torch.tensor([seq_lens[i] for i in group], device=device)
                mask = (torch.arange(longest, device=device) < lens[:, None])[:, None, None, :]
            self.parts.append((len(group), longest, as_tensor(gather), as_tensor(valid),
                               as_tensor(rows), mask))  # fmt: skip

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0
    ) -> torch.Tensor:
        """q [N, H, D], k and v [N, KVH, D] of the step's tokens in flat order; returns
        [N, H, D]. `window` > 0: each query sees the keys at most `window` positions away,
        before or after it."""
        n, heads, dim = q.shape
        repeat = heads // k.shape[1]
        out = torch.empty(n, heads, dim, dtype=q.dtype, device=q.device)
        for index, (size, longest, gather, valid, rows, mask) in enumerate(self.parts):
            qs, ks, vs = (t[gather].view(size, longest, -1, dim).transpose(1, 2) for t in (q, k, v))
            if repeat > 1:  # grouped-query attention: each KV head serves `repeat` queries
                ks, vs = ks.repeat_interleave(repeat, 1), vs.repeat_interleave(repeat, 1)
            if window and window < longest - 1:
                mask = self._window_mask(index, longest, window, mask, q.device)
            a = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
            out[rows] = a.transpose(1, 2).reshape(size * longest, heads, dim)[valid]
        return out

    def _window_mask(self, index, longest, window, keys, device) -> torch.Tensor:
        key = (index, window)
        if key not in self._windowed:
            at = torch.arange(longest, device=device)
            band = ((at[:, None] - at[None, :]).abs() <= window)[None, None]
            self._windowed[key] = band if keys is None else band & keys
        return self._windowed[key]
