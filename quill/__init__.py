"""quill: an inference server for language models."""

from quill.engine.outputs import CompletionOutput, RequestOutput
from quill.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    # Imported lazily so that `quill.engine.scheduler` and friends stay importable without torch.
    if name == "LLM":
        from quill.llm import LLM

        return LLM
    if name == "LLMEngine":
        from quill.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
