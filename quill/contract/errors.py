"""Errors that name what is wrong, so the API can map them to OpenAI's error body."""

from __future__ import annotations


class QuillError(Exception):
    """Base class of quill's own errors."""


class InvalidRequestError(QuillError, ValueError):
    """A request that can never be served as asked (HTTP 400). `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ModelLoadError(QuillError, ValueError):
    """The model could not be loaded: unsupported architecture, missing file, bad tensor."""


class OverloadedError(QuillError):
    """The request would wait past its TTFT SLO (HTTP 503 with Retry-After)."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after


class ExecutorFailedError(QuillError):
    """The model executor cannot go on (a tensor-parallel rank died, hung or fell out of step):
    the engine stops rather than retry the step."""


class EngineDeadError(QuillError):
    """The engine process is gone (crashed, killed, out of memory): nothing more is served."""
