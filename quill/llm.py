"""The offline interface: `LLM(...).generate(prompts, params)`, `LLM(...).chat(messages)` and
`LLM(...).embed(prompts)`."""

from __future__ import annotations

from collections.abc import Sequence

from quill.config import EngineConfig
from quill.contract.errors import InvalidRequestError
from quill.contract.outputs import RequestOutput
from quill.contract.pooling import PoolingParams
from quill.contract.sampling_params import SamplingParams
from quill.engine.llm_engine import LLMEngine
from quill.frontend.chat import ChatFormat, prepare_chat
from quill.frontend.pooling_config import PoolingConfig
from quill.frontend.scoring import scorer_for
from quill.frontend.tools import read_tools

Prompt = str | list[int] | dict


class LLM:
    """Runs an engine to completion over a batch of prompts, like vLLM's `LLM`."""

    def __init__(self, model: str | None = None, **engine_options) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self._counter = 0
        self._chat_format: ChatFormat | None = None

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

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[list[float]]:
        """Each prompt's embedding: its final hidden states pooled (`pooling`; by default as
        the model's sentence-transformers files say, else the last token's, normalized),
        computed in one continuous batch with anything else the engine runs; in input order."""
        if pooling is None:
            info = self.engine.worker.info
            pooling = PoolingConfig.read(info.model_path, info.encoder).params(None, None)
        params = SamplingParams(max_tokens=0, pooling=pooling)
        return [out.embedding for out in self.generate(prompts, params, use_tqdm)]

    def score(
        self,
        query: str,
        documents: Sequence[str],
        instruction: str | None = None,
        use_tqdm: bool = True,
    ) -> list[float]:
        """Each document's relevance to `query`: a reranker's P(yes) (`task="score"`), or the
        cosine of an embedding model's vectors (quill/frontend/scoring.py)."""
        info = self.engine.worker.info
        pooling = PoolingConfig.read(info.model_path, info.encoder)
        scorer = scorer_for(info.task, self.tokenizer, pooling, info.cross_encoder)
        if scorer is None:
            raise InvalidRequestError("this model scores nothing: load an embedding model, or "
                                      'a reranker with task="score"', "model")  # fmt: skip
        pairs = [(query, d) for d in documents]
        inputs = scorer.inputs(self.tokenizer, pairs, instruction)
        params = [SamplingParams(max_tokens=0, pooling=p) for _, p in inputs]
        outs = self.generate([ids for ids, _ in inputs], params, use_tqdm)
        return scorer.scores(pairs, [o.embedding for o in outs])

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
        chat_template_kwargs: dict | None = None,
        thinking_budget: int | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate.

        `tools`, `tool_choice`, `parallel_tool_calls` as in OpenAI's API: offered in the model's
        own tool format (quill/frontend/chat.py; the generic one for a template that renders no
        tools), "required" and named calls constrained to it. `chat_template_kwargs` reach the
        template (Qwen3's enable_thinking); `thinking_budget` caps a reasoning model's thinking.
        `quill.server.tools.ReplyReader` reads a reply as OpenAI's message (see `chat_turn`).
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        many = not (sampling_params is None or isinstance(sampling_params, SamplingParams))
        given = list(sampling_params) if many else [sampling_params or SamplingParams()]
        functions, choice = read_tools(tools, tool_choice, parallel_tool_calls)
        if choice is not None and any(p.structured is not None for p in given):
            raise InvalidRequestError("tools and a structured output constraint exclude "
                                      "each other", param="tools")  # fmt: skip
        prompts, params = [], []
        for i, conversation in enumerate(conversations):
            p = given[i] if many else given[0]
            turn = self.chat_turn(conversation, functions, choice, p.structured,
                                  chat_template_kwargs, add_generation_prompt)  # fmt: skip
            prompts.append(turn.prompt_ids)
            params.append(turn.sampling_params(p, thinking_budget))
        return self.generate(prompts, params, use_tqdm)

    def chat_turn(
        self,
        messages: list[dict],
        functions=None,
        choice=None,
        structured=None,
        chat_template_kwargs: dict | None = None,
        add_generation_prompt: bool = True,
    ):
        """One conversation in the model's chat format (quill.frontend.chat.ChatTurn): its
        prompt, and what `ReplyReader(turn.choice, turn.tools, turn.reasoning, turn.opened)`
        needs to read the reply."""
        if self._chat_format is None:
            self._chat_format = ChatFormat.choose(self.tokenizer.hf.chat_template)
        return prepare_chat(self.tokenizer, self._chat_format, messages, functions, choice,
                            structured, "structured", chat_template_kwargs,
                            add_generation_prompt)  # fmt: skip


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts
