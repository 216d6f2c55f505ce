"""The offline interface: `LLM(...).generate(prompts, params)` and `LLM(...).chat(messages)`."""

from __future__ import annotations

from collections.abc import Sequence

from quill.config import EngineConfig
from quill.contract.outputs import RequestOutput
from quill.contract.sampling_params import SamplingParams
from quill.engine.llm_engine import LLMEngine

Prompt = str | list[int] | dict


class LLM:
    """Runs an engine to completion over a batch of prompts, like vLLM's `LLM`."""

    def __init__(self, model: str | None = None, **engine_options) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def close(self) -> None:
        """Stop the engine's other processes (tensor-parallel ranks), if it has any."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt in one continuous batch; outputs come back in input order.
        `priority`, one per prompt (lower first), needs `scheduling_policy="priority"`."""
        prompts = _as_prompt_list(prompts)
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(priority)} priorities")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                if isinstance(prompt, dict):
                    prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
                self._counter += 1
                ids.append(
                    self.engine.add_request(
                        prompt,
                        p,
                        request_id=f"gen-{self._counter}",
                        priority=0 if priority is None else priority[i],
                    )
                )
        except Exception:
            for rid in ids:  # leave nothing half-queued behind a bad prompt
                self.engine.abort_request(rid)
            self._run({})
            raise
        return self._run({rid: i for i, rid in enumerate(ids)}, use_tqdm and len(ids) > 1)

    def _run(self, index: dict[str, int], use_tqdm: bool = False) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(index)
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(index), desc="generating", unit="req", dynamic_ncols=True)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished and out.request_id in index:
                    results[index[out.request_id]] = out
                    if bar:
                        bar.update(1)
        if bar:
            bar.close()
        return results  # type: ignore[return-value]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.encode_chat(c, add_generation_prompt=add_generation_prompt)
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts
