"""The console's routes: the page, its static files, the JSON it polls, the figures it links,
and the door for a browser.

A browser cannot send `Authorization: Bearer` when it opens a page, so with an API key set the
page answers 401 with a small sign-in page; signing in posts the key to `/console/login`, which
sets a cookie the guard accepts in place of the header (HttpOnly, so no script reads it back;
SameSite=Strict, so no other site's page can send it). The page's own fetches, the playground's
completions included, then carry the cookie like any same-origin request.
"""

from __future__ import annotations

import hashlib
import hmac
import mimetypes
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import BaseModel, ValidationError

import quill
from quill.server.errors import APIError, bad_request

STATIC = Path(__file__).parent / "static"
PAGE_PATHS = frozenset({"/", "/console"})
LOGIN_PATH = "/console/login"
COOKIE = "quill_console"
ASSETS = ("console.js", "console.css")
FIGURE_SUFFIXES = (".png", ".svg")
# Where `quill bench experiments` writes its figures by default (relative to the directory
# the server runs in); `quill bench serve --plot DIR` writes where it is told.
DEFAULT_FIGURE_DIRS = (Path("docs/figures/experiments"),)


class _Login(BaseModel):
    api_key: str


def cookie_token(api_key: str) -> str:
    """The cookie's value for a key: a digest, so the cookie jar never holds the key itself."""
    return hashlib.sha256(f"quill console:{api_key}".encode()).hexdigest()


def login_page() -> bytes:
    return (STATIC / "login.html").read_bytes()


def _no_store(response: Response) -> Response:
    response.headers["Cache-Control"] = "no-store"
    return response


def list_figures(dirs: list[Path]) -> list[dict]:
    """The figures present now (a bench run may add some while the server runs)."""
    found = []
    for index, directory in enumerate(dirs):
        if not directory.is_dir():
            continue
        for path in sorted(directory.iterdir()):
            if path.suffix.lower() in FIGURE_SUFFIXES and path.is_file():
                found.append(
                    {
                        "name": path.name,
                        "directory": str(directory),
                        "url": f"/console/figures/{index}/{path.name}",
                        "modified": path.stat().st_mtime,
                    }
                )
    return found


def install_console(app: FastAPI, ctx) -> None:
    """Add the console's routes to the app (see the module docstring)."""

    async def page() -> Response:
        return _no_store(FileResponse(STATIC / "console.html", media_type="text/html"))

    for path in PAGE_PATHS:
        app.add_api_route(path, page, methods=["GET"], include_in_schema=False)

    @app.get("/console/static/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in ASSETS:
            raise APIError(404, f"no console file {name!r}")
        media = mimetypes.guess_type(name)[0] or "application/octet-stream"
        return _no_store(FileResponse(STATIC / name, media_type=media))

    @app.get("/console/state")
    async def console_state() -> Response:
        """What the console page draws (quill/server/console/state.py)."""
        info = ctx.engine.info
        price = info.price_per_hour if info else None
        state = ctx.metrics.console.snapshot(time.monotonic(), price)
        state["server"] = {
            "version": quill.__version__,
            "model": ctx.model_name,
            "max_model_len": ctx.max_model_len,
            "hardware": info.hardware_name if info else None,
            "price_per_hour": price,
            "api_key_required": ctx.api_key is not None,
        }
        return _no_store(JSONResponse(state))

    @app.get("/console/figures")
    async def figures() -> Response:
        """The bench figures the page links (`--console-figures`)."""
        dirs = [str(d) for d in ctx.console_figures]
        figures = list_figures(ctx.console_figures)
        return _no_store(JSONResponse({"directories": dirs, "figures": figures}))

    @app.get("/console/figures/{index}/{name}", include_in_schema=False)
    async def figure(index: int, name: str) -> Response:
        # Only a name the listing shows: no path from the request ever reaches the disk.
        for f in list_figures(ctx.console_figures):
            if f["url"] == f"/console/figures/{index}/{name}":
                return FileResponse(Path(f["directory"]) / f["name"])
        raise APIError(404, f"no figure {name!r}")

    @app.post(LOGIN_PATH, include_in_schema=False)
    async def login(request: Request) -> Response:
        try:  # pydantic's parser bounds nesting; json.loads would recurse past its limit
            given = _Login.model_validate_json(await request.body()).api_key
        except ValidationError:
            raise bad_request('send {"api_key": "..."}', "api_key") from None
        key = ctx.api_key
        if key is None:
            return JSONResponse({"signed_in": True})
        if not hmac.compare_digest(cookie_token(given), cookie_token(key)):
            raise APIError(401, "Incorrect API key.", param="api_key", code="invalid_api_key")
        response = JSONResponse({"signed_in": True})
        response.set_cookie(COOKIE, cookie_token(key), httponly=True, samesite="strict")
        return response

    @app.post("/console/logout", include_in_schema=False)
    async def logout() -> Response:
        response = JSONResponse({"signed_in": False})
        response.delete_cookie(COOKIE, httponly=True, samesite="strict")
        return response
