"""The offline interface: `LLM(...).generate(prompts, params)` and `LLM(...).chat(messages)`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from quill.config import EngineConfig
from quill.contract.errors import InvalidRequestError
from quill.contract.outputs import RequestOutput
from quill.contract.sampling_params import SamplingParams
from quill.engine.llm_engine import LLMEngine
from quill.frontend.tools import read_tools, render_conversation, reply_constraint

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
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        parallel_tool_calls: bool | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate.

        `tools`, `tool_choice`, `parallel_tool_calls` as in OpenAI's API: the functions are
        offered in the prompt and each reply held to the generic tool format (one JSON
        object: calls or, under "auto", a text answer); `quill.server.tools.ToolCalls(choice)
        .message(output.text)` reads a reply as OpenAI's message.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        functions, choice = read_tools(tools, tool_choice, parallel_tool_calls)
        if choice is not None:
            constraint = reply_constraint(functions, choice)
            many = not (sampling_params is None or isinstance(sampling_params, SamplingParams))
            given = list(sampling_params) if many else [sampling_params or SamplingParams()]
            if any(p.structured is not None for p in given):
                raise InvalidRequestError("tools and a structured output constraint exclude "
                                          "each other", param="tools")  # fmt: skip
            given = [replace(p, structured=constraint) for p in given]
            sampling_params = given if many else given[0]
        prompts = [
            self.tokenizer.encode_chat(
                render_conversation(c, functions, choice),
                add_generation_prompt=add_generation_prompt,
            )
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
