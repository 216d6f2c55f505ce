"""OpenAI's Responses API: the request and its translation into a chat request (protocol.py),
the output items and typed stream events (builder.py), stored responses (store.py), the routes."""
