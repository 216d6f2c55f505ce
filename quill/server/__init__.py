"""The OpenAI-compatible HTTP server: `quill serve`.

protocol (request schemas) -> app (routes) -> completions / chat (endpoint logic) -> generation
(fan-out and streaming of engine requests) -> engine_client (the engine process, over ZeroMQ);
metrics, errors, serve (CLI and uvicorn).
"""
