"""quill: an inference server for language models."""

from quill.contract.outputs import CompletionOutput, RequestOutput
from quill.contract.sampling_params import SamplingParams

__version__ = "0.1.0"


def _default_logging() -> None:
    # Like vLLM, say what the engine is doing (the KV pool, compiling) unless the app set logging.
    import logging

    logger = logging.getLogger("quill")
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


_default_logging()

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
