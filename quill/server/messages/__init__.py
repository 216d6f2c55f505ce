"""Anthropic's Messages API: the request and its translation into a chat request (protocol.py),
the content blocks and stream events (builder.py), the routes."""
