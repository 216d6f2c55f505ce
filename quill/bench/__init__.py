"""Benchmark clients for OpenAI-compatible servers: `quill bench serve`, and the streaming
client the scripts under benchmarks/ use."""
