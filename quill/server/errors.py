"""API errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, on the
paths of Anthropic's Messages API in Anthropic's: {"type": "error", "error": {"type",
"message"}}, its type named after the status (`ANTHROPIC_TYPES`), and on Ollama's (/api/...)
in Ollama's: {"error": "message"}.

Every failure a client can cause maps to a 4xx with that body; anything else becomes a 500 with
the same shape and no traceback (the traceback goes to the server's log).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from quill.contract.errors import InvalidRequestError

log = logging.getLogger(__name__)

# Union members show up in pydantic's error locations ("stop", "list[str]", 0); they name a
# schema branch, not a field of the request, so they are left out of `param`.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


class APIError(Exception):
    """An error response: status, OpenAI error body, optional headers (e.g. Retry-After)."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self, path: str = "") -> dict:
        """The error's body in the shape of the API at `path`."""
        if is_anthropic(path):
            return anthropic_body(self.status_code, self.message)
        if path.startswith(OLLAMA_PREFIX):  # Ollama's: the message alone, the field named in it
            named = self.param and self.param not in self.message
            return {"error": f"{self.param}: {self.message}" if named else self.message}
        return error_body(self.message, self.type, self.param, self.code)

    def response(self, path: str = "") -> JSONResponse:
        return JSONResponse(self.body(path), status_code=self.status_code, headers=self.headers)

    async def __call__(self, scope, receive, send) -> None:
        """As an ASGI app (the guard's refusals, before any route)."""
        await self.response(scope.get("path", ""))(scope, receive, send)


ANTHROPIC_PATH = "/v1/messages"
OLLAMA_PREFIX = "/api/"
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def is_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def anthropic_body(status: int, message: str) -> dict:
    kind = ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code=None
) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def from_invalid(e: InvalidRequestError) -> APIError:
    return bad_request(e.message, e.param)


def from_validation_error(e: ValidationError | RequestValidationError) -> APIError:
    """The first problem pydantic found, phrased for a client."""
    errors = e.errors()
    if not errors:
        return bad_request("invalid request")
    # With unions, pydantic reports one error per branch; the deepest one is the most telling
    # ("content.0.type: Input should be 'text'" rather than "content: not a string").
    err = max(errors, key=lambda e: len(e.get("loc", ())))
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, InvalidRequestError):
        return from_invalid(cause)
    kind = err.get("type", "")
    loc = [
        str(p)
        for p in err.get("loc", ())
        if p != "body" and not ("[" in str(p) or str(p).lower() in _TYPE_TAGS)
    ]
    param = ".".join(loc) or None
    if kind == "json_invalid":
        reason = (err.get("ctx") or {}).get("error", err.get("msg"))
        return bad_request(f"We could not parse the JSON body of your request: {reason}")
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param)
    if kind == "missing":
        return bad_request(f"Missing required parameter: '{param}'", param)
    if kind == "model_type" and not loc:
        return bad_request("The request body must be a JSON object")
    return bad_request(f"{param}: {err.get('msg')}" if param else str(err.get("msg")), param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return from_invalid(exc).response(request.url.path)

    @app.exception_handler(ValidationError)
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc) -> JSONResponse:
        return from_validation_error(exc).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        error = APIError(exc.status_code, str(exc.detail), kind, headers=exc.headers)
        return error.response(request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return APIError(500, "internal server error", "server_error").response(request.url.path)


def renamed(error: APIError | InvalidRequestError, names: dict[str, str]) -> APIError:
    """`error` with its field named as another API names it (`names`: ours -> theirs), for
    an API translated into chat completions (the Responses API's `input` is chat's
    `messages`)."""
    if isinstance(error, InvalidRequestError):
        error = from_invalid(error)
    param = error.param
    if param is not None:
        head, _, rest = param.partition(".")
        if head in names:
            param = names[head] + ("." + rest if rest else "")
            message = error.message.replace(error.param, param, 1)
            error = APIError(error.status_code, message, error.type, param, error.code,
                             error.headers)  # fmt: skip
    return error
