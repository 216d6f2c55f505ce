"""The OpenAI-compatible HTTP server: `quill serve`.

protocol (request schemas) -> app (routes) -> completions / chat (endpoint logic) -> generation
(fan-out and streaming of engine requests) -> async_engine (engine thread) ; metrics, errors,
serve (CLI and uvicorn).
"""
