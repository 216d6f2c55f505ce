"""Paged attention, native kernel and PyTorch reference, against a plain float64 computation.

Random paged layouts: block tables in any order with spare blocks, contexts from 1 to a few
thousand tokens, GQA ratios 1 to 8, head dims 64 / 128 / 256, block sizes 16 and 32, decodes
and prompt chunks over cached contexts in one step, padding tokens; every cache dtype. The
expected output is computed here from the logical keys and values (the cache is built from them
by this file's own layout code, independent of quill's), so it checks the cache layout and the
write of the step's keys as well as the attention. The native library in this process is the
best one the CPU runs; `test_avx2_library` reruns the native tests under the AVX2 library
wherever the CPU also runs AVX-512. The tests marked `device` run the PyTorch path on --device
(a GPU's attention path); the native kernel is the CPU's alone.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quill.contract.kv_groups import NULL_BLOCK, first_needed_block
from quill.contract.plan import SeqPlan
from quill.model.attention import AttentionLayout, native_supported, paged_attention
from quill.ops import library
from tests.conftest import NATIVE

needs_native = pytest.mark.skipif(NATIVE is None, reason="no native library built for this CPU")
PATHS = ["reference", pytest.param("native", marks=needs_native)]


def int8_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This file's own int8 quantizer, the cache's rule: per 32 dimensions of a token's head
    an fp16 scale s = fp16(max |x| / 127) and codes round-half-even(x / s) in [-127, 127]."""
    groups = x.float().reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    s16 = (groups.abs().amax(-1) / 127).half()
    s = s16.float().unsqueeze(-1)
    codes = torch.where(s > 0, (groups / s).round(), torch.zeros(())).clamp(-127, 127)
    return codes.to(torch.int8).reshape(x.shape), s16


def rounded_queries(q: torch.Tensor) -> torch.Tensor:
    """Queries as both paths multiply them against int8 keys: per 32 dimensions the fp32
    scale max |q| / 32767 and int16 codes round-half-even(q * (1 / scale)), in float64."""
    groups = q.float().reshape(*q.shape[:-1], q.shape[-1] // 32, 32)
    s = groups.abs().amax(-1, keepdim=True) / 32767
    codes = torch.where(s > 0, (groups * (1 / s)).round(), torch.zeros(()))
    return (codes.double() * s.double()).reshape(q.shape)


def stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What a cache of `dtype` holds for x, as logical values (int8: codes times scales)."""
    if dtype != torch.int8:
        return x.to(dtype)
    codes, s16 = int8_codes(x)
    return (codes.float().unflatten(-1, (-1, 32)) * s16.float().unsqueeze(-1)).flatten(-2)


def to_cache(
    keys: torch.Tensor, values: torch.Tensor, k_dtype: torch.dtype, v_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logical [blocks, kv_heads, block_size, head_dim] keys and values in the cache layout:
    keys transposed in each block; bf16 with row pairs interleaved; int8 codes then fp16
    scales [head_dim / 32, block_size] per (block, head) chunk (csrc/cache_layout.h)."""
    n, h, bs, d = keys.shape

    def chunks(codes: torch.Tensor, s16: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        scale_bytes = s16.transpose(2, 3).contiguous().view(torch.int8).reshape(n, h, -1)
        both = torch.cat([codes.reshape(n, h, -1), scale_bytes], dim=2)
        return both.view(n, h, rows // 16 * 17, cols)

    if k_dtype == torch.int8:  # codes in the bf16 layout's pairs: keys [D / 2, S, 2]
        codes, s16 = int8_codes(keys)
        pairs = codes.view(n, h, bs, d // 2, 2).permute(0, 1, 3, 2, 4).contiguous()
        k = chunks(pairs, s16, d, bs)
    elif k_dtype == torch.bfloat16:
        k = keys.to(k_dtype).view(n, h, bs, d // 2, 2).permute(0, 1, 3, 2, 4).contiguous()
    else:
        k = keys.to(k_dtype).transpose(2, 3).contiguous()
    if v_dtype == torch.int8:  # values [S / 2, D, 2]
        codes, s16 = int8_codes(values)
        pairs = codes.view(n, h, bs // 2, 2, d).permute(0, 1, 2, 4, 3).contiguous()
        v = chunks(pairs, s16, bs, d)
    elif v_dtype == torch.bfloat16:
        v = values.to(v_dtype).view(n, h, bs // 2, 2, d).permute(0, 1, 2, 4, 3).contiguous()
    else:
        v = values.to(v_dtype).contiguous()
    return k, v


def from_cache(
    k: torch.Tensor, v: torch.Tensor, block_size: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    n, h, bs, d = k.shape[0], k.shape[1], block_size, head_dim

    def dequantized(cache: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        flat = cache.reshape(n, h, -1)
        codes = flat[:, :, : rows * cols].reshape(n, h, rows, cols).float()
        s16 = flat[:, :, rows * cols :].contiguous().view(torch.float16).reshape(n, h, d // 32, bs)
        return codes, s16.float()

    if k.dtype == torch.int8:
        pairs, s = dequantized(k, d, bs)  # [n, h, D, S] as read, scales [n, h, D / 32, S]
        codes = pairs.reshape(n, h, d // 2, bs, 2).permute(0, 1, 3, 2, 4).reshape(n, h, bs, d)
        keys = codes * s.transpose(2, 3).repeat_interleave(32, dim=3)
    elif k.dim() == 5:
        keys = k.permute(0, 1, 3, 2, 4).reshape(n, h, bs, d)
    else:
        keys = k.transpose(2, 3)
    if v.dtype == torch.int8:
        pairs, s = dequantized(v, bs, d)  # [n, h, S, D] as read
        codes = pairs.reshape(n, h, bs // 2, d, 2).permute(0, 1, 2, 4, 3).reshape(n, h, bs, d)
        values = codes * s.transpose(2, 3).repeat_interleave(32, dim=3)
    elif v.dim() == 5:
        values = v.permute(0, 1, 2, 4, 3).reshape(n, h, bs, d)
    else:
        values = v
    return keys, values


@dataclass
class Step:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    seqs: list[SeqPlan]
    slots: torch.Tensor
    expected: torch.Tensor  # float64
    expected_keys: torch.Tensor  # logical cache after the step's writes
    expected_values: torch.Tensor
    scale: float
    window: int = 0


def random_step(
    rng: random.Random,
    q_lens: list[int],
    starts: list[int],
    heads: int = 6,
    kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    q_dtype: torch.dtype = torch.float32,
    kv_dtype: torch.dtype | tuple[torch.dtype, torch.dtype] = torch.float32,
    padding: int = 0,
    window: int = 0,
) -> Step:
    """`kv_dtype`: the cache's, or (the K cache's, the V cache's)."""
    k_dtype, v_dtype = kv_dtype if isinstance(kv_dtype, tuple) else (kv_dtype, kv_dtype)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    needed = sum(-(-(s + q) // block_size) + 1 for s, q in zip(starts, q_lens))
    num_blocks = needed + 2  # and one scratch block at the end, for padding tokens
    shape = (num_blocks + 1, kv_heads, block_size, head_dim)
    # The logical keys and values: what the cache holds, exactly (int8's decoded in fp32).
    keys = stored(torch.randn(shape, generator=gen), k_dtype)
    values = stored(torch.randn(shape, generator=gen), v_dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    seqs = []
    for n, (q_len, start) in enumerate(zip(q_lens, starts)):
        total = start + q_len
        count = -(-total // block_size) + rng.choice([0, 0, 1])  # sometimes a spare block
        table = [free.pop() for _ in range(count)]
        seqs.append(SeqPlan(f"r{n}", [0] * q_len, start, total, [table], samples=True))
    seqs.sort(key=lambda s: len(s.token_ids) > 1)  # decodes first, as the runner lays them out
    num_tokens = sum(q_lens)
    q = torch.randn(num_tokens + padding, heads, head_dim, generator=gen).to(q_dtype)
    k = torch.randn(num_tokens + padding, kv_heads, head_dim, generator=gen).to(q_dtype)
    v = torch.randn(num_tokens + padding, kv_heads, head_dim, generator=gen).to(q_dtype)
    slots = [
        s.block_tables[0][p // block_size] * block_size + p % block_size
        for s in seqs
        for p in range(s.start, s.context_len)
    ] + [num_blocks * block_size] * padding
    k_cache, v_cache = to_cache(keys, values, k_dtype, v_dtype)

    new_keys, new_values = keys.clone(), values.clone()
    for row, slot in enumerate(slots[:num_tokens]):
        block, offset = slot // block_size, slot % block_size
        new_keys[block, :, offset] = stored(k[row], k_dtype).to(keys.dtype)
        new_values[block, :, offset] = stored(v[row], v_dtype).to(values.dtype)
    scale = head_dim**-0.5
    expected = torch.zeros(q.shape, dtype=torch.float64)
    row = 0
    group = heads // kv_heads
    for s in seqs:
        n, ctx = len(s.token_ids), s.context_len
        blocks = torch.tensor(s.block_tables[0])
        ks = new_keys[blocks].transpose(1, 2).reshape(-1, kv_heads, head_dim)[:ctx].double()
        vs = new_values[blocks].transpose(1, 2).reshape(-1, kv_heads, head_dim)[:ctx].double()
        ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)  # [ctx, H, D]
        queries = (
            q[row : row + n].double()
            if k_dtype != torch.int8
            else rounded_queries(q[row : row + n])
        )
        scores = torch.einsum("qhd,khd->hqk", queries, ks) * scale
        visible = torch.arange(ctx)[None, :] <= torch.arange(s.start, ctx)[:, None]
        if window:  # sliding window: the query at p sees keys p - window + 1 .. p
            visible &= torch.arange(ctx)[None, :] > torch.arange(s.start, ctx)[:, None] - window
        scores = scores.masked_fill(~visible, float("-inf"))
        expected[row : row + n] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs)
        row += n
    if window:  # the blocks behind every query's window freed, as a sliding KV group frees
        for s in seqs:  # them, and taken by someone else: NaN where the kernel must not read
            table = s.block_tables[0]
            for i in range(first_needed_block(window, s.start, block_size)):
                keys[table[i]] = values[table[i]] = float("nan")
                new_keys[table[i]] = new_values[table[i]] = float("nan")
                table[i] = NULL_BLOCK
        k_cache, v_cache = to_cache(keys, values, k_dtype, v_dtype)
    return Step(
        q,
        k,
        v,
        k_cache,
        v_cache,
        seqs,
        torch.tensor(slots),
        expected,
        new_keys,
        new_values,
        scale,
        window,
    )


def on(step: Step, device: torch.device, path: str) -> Step:
    """The step's inputs and cache on `device` (the expected values stay on the CPU)."""
    if path == "native" and device.type != "cpu":
        pytest.skip("the native kernel is the CPU's")
    moved = {f: getattr(step, f).to(device) for f in ("q", "k", "v", "k_cache", "v_cache", "slots")}
    return replace(step, **moved)


def run(step: Step, path: str) -> torch.Tensor:
    block_size = step.expected_keys.shape[2]
    scratch = step.expected_keys.shape[0] - 1
    layout = AttentionLayout(
        block_size, scratch, step.q.dtype, step.q.device, path == "native", step.window
    )
    meta = layout.build(step.seqs, step.slots)
    kv = (step.k_cache, step.v_cache)
    return paged_attention(step.q, step.k, step.v, kv, meta, step.scale)


def check(step: Step, out: torch.Tensor, atol: float, rtol: float) -> None:
    torch.testing.assert_close(out.double().cpu(), step.expected, atol=atol, rtol=rtol)
    block_size, head_dim = step.expected_keys.shape[2], step.expected_keys.shape[3]
    keys, values = from_cache(step.k_cache.cpu(), step.v_cache.cpu(), block_size, head_dim)
    num_tokens = sum(len(s.token_ids) for s in step.seqs)
    used = sorted({slot // block_size for slot in step.slots[:num_tokens].tolist()})
    torch.testing.assert_close(keys[used], step.expected_keys[used], atol=0, rtol=0)
    torch.testing.assert_close(values[used], step.expected_values[used], atol=0, rtol=0)


# Bounds: fp32 arithmetic on fp32 (or exactly widened 16-bit) inputs is within float rounding;
# bf16 queries round the output to bf16 (~2^-9 relative) and the native kernel also rounds the
# softmax weights to bf16 for its bf16 dot products. An int8 cache's logical values are its
# codes times their scales, exact in fp32, so it is held to the same bounds: the quantization's
# own error is checked by hand-worked cases below and in tests/test_kv_int8.py.
TOLERANCE = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3)}


def tolerance(q_dtype: torch.dtype, kv_dtype, path: str) -> tuple[float, float]:
    """TOLERANCE, and for the native kernel on int8 values the rounding of the softmax
    weights to int16 (half a step of a tile's largest weight, 1/65534 of it, per weight)."""
    atol, rtol = TOLERANCE[q_dtype]
    v_dtype = kv_dtype[1] if isinstance(kv_dtype, tuple) else kv_dtype
    if path == "native" and v_dtype == torch.int8:
        atol, rtol = max(atol, 2e-4), max(rtol, 2e-4)
    return atol, rtol


CASES = {
    "decodes only": ([1, 1, 1, 1], [5, 17, 0, 30]),
    "one prompt, no context": ([9], [0]),
    "decodes and a first chunk": ([1, 1, 7], [3, 12, 0]),
    "a later chunk over cached context": ([6], [10]),
    "mixed decodes and chunks": ([1, 5, 1, 3, 40], [21, 0, 2, 13, 70]),
    "chunks of different lengths": ([2, 9, 4], [0, 7, 16]),
    "one long decode": ([1], [2000]),
    "a chunk past many tiles": ([200], [300]),
}
# Sliding windows (Mistral's): shorter than a chunk, than a tile, than the context; a window
# that starts mid-block, and a decode whose split key range begins before its window.
WINDOW_CASES = {
    "a first chunk longer than its window": ([40], [0], 7),
    "decodes and chunks over a window of a few blocks": ([1, 5, 1, 30], [21, 0, 300, 70], 50),
    "one long decode, its window far from the start": ([1], [2000], 300),
    "a chunk past many tiles, window of one tile": ([200], [300], 128),
    "a window wider than the context": ([3, 1], [10, 4], 1000),
}


@pytest.mark.device
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("padding", [0, 3])
def test_matches_reference(path, case, padding, device):
    q_lens, starts = CASES[case]
    step = on(random_step(random.Random(case), q_lens, starts, padding=padding), device, path)
    check(step, run(step, path), *TOLERANCE[torch.float32])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "q_dtype,kv_dtype",
    [
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float16),
        (torch.float32, torch.int8),
        (torch.bfloat16, torch.int8),
        (torch.float32, (torch.int8, torch.float32)),
        (torch.bfloat16, (torch.bfloat16, torch.int8)),
        (torch.bfloat16, (torch.int8, torch.bfloat16)),
        (torch.float32, (torch.float16, torch.int8)),
    ],
)
@pytest.mark.device
def test_cache_dtypes(path, q_dtype, kv_dtype, device):
    step = random_step(
        random.Random(3), [1, 1, 13, 1], [40, 3, 20, 300], q_dtype=q_dtype, kv_dtype=kv_dtype
    )
    step = on(step, device, path)
    check(step, run(step, path), *tolerance(q_dtype, kv_dtype, path))


@st.composite
def layouts(draw):
    group = draw(st.sampled_from([1, 2, 3, 4, 8]))
    kv_heads = draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([64, 128, 256]))
    block_size = draw(st.sampled_from([16, 32]))
    n = draw(st.integers(1, 5))
    q_lens = [draw(st.sampled_from([1, 1, 1, draw(st.integers(2, 70))])) for _ in range(n)]
    starts = [draw(st.sampled_from([0, draw(st.integers(0, 40)), draw(st.integers(0, 3000))]))]
    starts += [draw(st.integers(0, 400)) for _ in range(n - 1)]
    floats = [torch.float32, torch.bfloat16, torch.float16]
    kv_dtype = draw(
        st.sampled_from(
            [*floats, torch.int8, torch.int8]
            + [(torch.int8, f) for f in floats]
            + [(f, torch.int8) for f in floats]
        )
    )
    q_dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return dict(
        q_lens=q_lens,
        starts=starts,
        heads=group * kv_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        q_dtype=q_dtype,
        kv_dtype=kv_dtype,
        padding=draw(st.sampled_from([0, 2])),
        window=draw(st.sampled_from([0, 0, draw(st.integers(1, 400))])),
        seed=draw(st.integers(0, 1 << 20)),
    )


@needs_native
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts())
def test_native_random_layouts(case):
    seed = case.pop("seed")
    step = random_step(random.Random(seed), **case)
    check(step, run(step, "native"), *tolerance(case["q_dtype"], case["kv_dtype"], "native"))


@pytest.mark.device
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", sorted(WINDOW_CASES))
def test_a_sliding_window_matches_the_reference(path, case, device):
    q_lens, starts, window = WINDOW_CASES[case]
    step = random_step(random.Random(case), q_lens, starts, padding=2, window=window)
    step = on(step, device, path)
    check(step, run(step, path), *TOLERANCE[torch.float32])


@pytest.mark.device
def test_reference_random_layouts(device):
    rng = random.Random(7)
    for _ in range(12):
        n = rng.randint(1, 5)
        q_lens = [rng.choice([1, 1, rng.randint(2, 30)]) for _ in range(n)]
        starts = [rng.randint(0, 200) for _ in range(n)]
        kv_dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16, torch.int8])
        kv_dtype = rng.choice([kv_dtype, (kv_dtype, torch.int8), (torch.int8, kv_dtype)])
        step = random_step(rng, q_lens, starts, kv_dtype=kv_dtype, padding=rng.choice([0, 2]))
        step = on(step, device, "reference")
        check(step, run(step, "reference"), *TOLERANCE[torch.float32])


def test_reference_custom_op_matches():
    """The op compiled models call on the PyTorch path (no workspace: it allocates)."""
    step = random_step(random.Random(1), [1, 4, 1, 6], [9, 0, 3, 5], padding=2)
    layout = AttentionLayout(
        16, step.expected_keys.shape[0] - 1, torch.float32, step.q.device, False
    )
    r = layout.build(step.seqs, step.slots).reference
    out = torch.ops.quill_reference.paged_attention(
        step.q,
        step.k,
        step.v,
        step.k_cache,
        step.v_cache,
        step.slots,
        r.decode_tables,
        r.decode_bias,
        r.prefill_index,
        r.prefill_rows,
        r.prefill_tables,
        r.prefill_bias,
        step.scale,
    )
    check(step, out, *TOLERANCE[torch.float32])


@needs_native
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8, (torch.bfloat16, torch.int8)])
def test_native_ops_pass_opcheck(kv_dtype):
    step = random_step(random.Random(5), [1, 6, 1], [20, 9, 3], kv_dtype=kv_dtype)
    layout = AttentionLayout(
        16, step.expected_keys.shape[0] - 1, torch.float32, step.q.device, True
    )
    meta = layout.build(step.seqs, step.slots)
    args = (step.q, step.k, step.v, step.k_cache, step.v_cache, step.slots)
    torch.library.opcheck(
        torch.ops.quill.paged_attention.default,
        (*args, meta.block_tables, meta.seq_lens, meta.query_start_loc, step.scale),
    )
    torch.library.opcheck(torch.ops.quill.write_kv.default, args[1:])
    # The probe returns a timing, different on every call: every check but comparing outputs.
    torch.library.opcheck(
        torch.ops.quill.read_probe.default,
        (torch.ones(4096), 1, 1),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )


@needs_native
def test_native_refuses_bad_metadata():
    step = random_step(random.Random(2), [1, 4], [30, 0])
    layout = AttentionLayout(
        16, step.expected_keys.shape[0] - 1, torch.float32, step.q.device, True
    )
    meta = layout.build(step.seqs, step.slots)
    args = (step.q, step.k, step.v, step.k_cache, step.v_cache, step.slots)
    bad_table = meta.block_tables.clone()
    bad_table[0, 0] = 10**6
    with pytest.raises(RuntimeError, match="block id"):
        torch.ops.quill.paged_attention(
            *args, bad_table, meta.seq_lens, meta.query_start_loc, step.scale
        )
    with pytest.raises(RuntimeError, match="int32"):
        torch.ops.quill.paged_attention(
            *args, meta.block_tables.long(), meta.seq_lens, meta.query_start_loc, step.scale
        )
    too_long = meta.seq_lens + 1000
    with pytest.raises(RuntimeError, match="keys for"):
        torch.ops.quill.paged_attention(
            *args, meta.block_tables, too_long, meta.query_start_loc, step.scale
        )


def test_native_supported_says_why_not():
    assert native_supported(torch.device("meta"), 64, 16, torch.float32) == "device meta"
    if NATIVE is not None:
        assert native_supported(torch.device("cpu"), 64, 16, torch.float32) is None
        assert "head_dim" in native_supported(torch.device("cpu"), 60, 16, torch.float32)
        assert "block_size" in native_supported(torch.device("cpu"), 64, 12, torch.float32)


@needs_native
def test_library_is_the_best_this_cpu_runs():
    runnable = library.runnable_isas()
    assert torch.ops.quill.isa() == NATIVE.isa
    expected = os.environ.get("QUILL_NATIVE_ISA") or runnable[0]
    assert NATIVE.isa == expected
