"""The door: what every HTTP request must pass before any route parses it.

One ASGI layer, outermost, so that no route can forget a check:
- the API key, on every path but /health, the console's sign-in and (unless asked) /metrics:
  as a Bearer header, as Anthropic's `x-api-key` header, or as the console's cookie
  (quill/server/console/routes.py); a page opened without it gets the sign-in page;
- refusals in the shape of the API the path belongs to (quill/server/errors.py);
- the body's media type: JSON, or none given (curl without -H); on Ollama's paths also curl's
  form type without an Origin (Ollama's documented `curl -d`). Anything else is a 415; this
  also keeps a web page from posting a "simple" text/plain request to a server on localhost,
  which a browser would send without asking;
- the body's size, from Content-Length before reading and counted while reading (413);
- a body that stalls is timed out (408), and a client that leaves halfway is one log line;
- the headers' size (431 past `MAX_HEADER_BYTES`), before any is parsed; the cookie is read by
  a linear scan (Python's cookie parser is quadratic in a quoted value's backslashes);
- a client's X-Request-Id: 1 to 128 printable ASCII characters (400 else), echoed back on the
  response and named in the log, never used as the engine's id (which is the server's own).

The body is read here, once, and replayed to the route; later `receive` calls (the disconnect
watch of non-streaming requests) go to the client.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from collections.abc import Awaitable, Callable

from starlette.responses import HTMLResponse, Response

from quill.server.console.routes import COOKIE, LOGIN_PATH, PAGE_PATHS, cookie_token
from quill.server.errors import APIError

log = logging.getLogger(__name__)

ARRIVAL = "quill.arrival_time"  # scope key: when the request reached the server

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]

_BODY_METHODS = {"POST", "PUT", "PATCH"}
# All request headers together, names and values: browsers send a few KiB at most (nginx's
# default line limit is 8 KiB).
MAX_HEADER_BYTES = 32 << 10
REQUEST_ID = "x-request-id"


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def _curl_to_ollama(path: str, headers: dict) -> bool:
    """Ollama's documented `curl URL -d '{...}'` sends a form's media type; on Ollama's paths
    it is read as JSON when no web page sent it (no Origin header: a browser always sends one
    on a cross-site POST)."""
    media = (headers.get("content-type") or "").split(";", 1)[0].strip().lower()
    return (path.startswith("/api/") and media == "application/x-www-form-urlencoded"
            and "origin" not in headers)  # fmt: skip


def is_json_media_type(content_type: str | None) -> bool:
    """No Content-Type, application/json or application/*+json (parameters allowed)."""
    if not content_type:
        return True
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


class _ClientGone(Exception):
    pass


class RequestGuard:
    """ASGI middleware enforcing the checks above; see the module docstring."""

    def __init__(
        self,
        app,
        api_key: str | None,
        max_request_bytes: int,
        body_timeout: float,
        metrics_require_key: bool = False,
        pages: Callable[[], bytes] | None = None,
    ) -> None:
        self.app = app
        self.expected_key = _digest(f"Bearer {api_key}") if api_key else None
        self.expected_header = _digest(api_key) if api_key else None  # x-api-key
        self.expected_cookie = _digest(cookie_token(api_key)) if api_key else None
        self.cookie_name = COOKIE
        self.open_paths = {"/health", LOGIN_PATH} | (set() if metrics_require_key else {"/metrics"})
        # Pages a browser opens get the sign-in page instead of a JSON 401.
        self.page_paths = PAGE_PATHS if pages is not None else frozenset()
        self.login_page = pages
        self.max_request_bytes = max_request_bytes
        self.body_timeout = body_timeout

    async def __call__(self, scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[ARRIVAL] = time.monotonic()
        if sum(len(k) + len(v) for k, v in scope["headers"]) > MAX_HEADER_BYTES:
            await _error(431, f"The request's headers exceed {MAX_HEADER_BYTES} bytes.")(
                scope, receive, send
            )
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        client_id = headers.get(REQUEST_ID)
        if client_id is not None:
            if not (0 < len(client_id) <= 128 and client_id.isascii() and client_id.isprintable()):
                await _error(400, "X-Request-Id must be 1 to 128 printable ASCII characters")(
                    scope, receive, send
                )
                return
            send = _echo_request_id(send, client_id)
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        if scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read_body(receive)
        except _ClientGone:
            log.info("%s %s: the client left before sending its whole body", *_where(scope))
            return
        except _Refused as e:
            await e.response(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    def _has_key(self, headers: dict[str, str]) -> bool:
        # Digests compare in constant time and do not leak the key's length either.
        given = _digest(headers.get("authorization", ""))
        if hmac.compare_digest(given, self.expected_key):
            return True
        if "x-api-key" in headers:
            given = _digest(headers["x-api-key"])
            if hmac.compare_digest(given, self.expected_header):
                return True
        value = cookie_value(headers.get("cookie", ""), self.cookie_name)
        return value is not None and hmac.compare_digest(_digest(value), self.expected_cookie)

    def _refusal(self, scope, headers: dict[str, str]) -> Response | APIError | None:
        if self.expected_key is not None and scope["path"] not in self.open_paths:
            if not self._has_key(headers):
                if scope["path"] in self.page_paths and scope["method"] == "GET":
                    return HTMLResponse(self.login_page(), status_code=401)
                return _error(
                    401,
                    "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>' (or "
                    "'x-api-key: <key>').",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        if scope["method"] not in _BODY_METHODS:
            return None
        if not is_json_media_type(headers.get("content-type")) and not _curl_to_ollama(
            scope["path"], headers
        ):
            return _error(
                415,
                f"Content-Type {headers['content-type']!r} is not supported; send the body as "
                "application/json.",
            )
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return _error(400, "Content-Length is not a number")
            if int(length) > self.max_request_bytes:
                return self._too_large()
        return None

    def _too_large(self) -> APIError:
        return _error(
            413,
            f"The request body is larger than this server accepts ({self.max_request_bytes} "
            "bytes; see --max-request-bytes).",
        )

    async def _read_body(self, receive: Receive) -> bytes:
        parts: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout)
            except TimeoutError:
                raise _Refused(
                    _error(408, f"No part of the request body arrived for {self.body_timeout:g} s.")
                ) from None
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_request_bytes:
                raise _Refused(self._too_large())
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)


class _Refused(Exception):
    def __init__(self, response: APIError) -> None:
        self.response = response


def _error(status: int, message: str, code: str | None = None, headers=None) -> APIError:
    """A refusal; called as an ASGI app it answers in the shape of the API the path is in."""
    return APIError(status, message, code=code, headers=headers)


def cookie_value(header: str, name: str) -> str | None:
    """The value of cookie `name` in a Cookie header (quotes around it removed), in one pass."""
    for part in header.split(";"):
        key, sep, value = part.partition("=")
        if sep and key.strip() == name:
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] == '"':
                value = value[1:-1]
            return value
    return None


def _echo_request_id(send: Send, request_id: str) -> Send:
    """`send` with the client's X-Request-Id added to the response's headers."""
    echoed = (REQUEST_ID.encode(), request_id.encode())

    async def echoing(message: dict) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), echoed]}
        await send(message)

    return echoing


def _where(scope) -> tuple[str, str]:
    return scope["method"], scope["path"]


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
