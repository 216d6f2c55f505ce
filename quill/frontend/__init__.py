"""The front end: text in and text out around the engine.

Tokenizing, chat templates, input validation that needs no engine state, incremental
detokenization and stop strings. It runs in the API process (`quill serve`) or in the caller's
process (`LLM`, `LLMEngine`); the engine core beneath it only ever sees token ids.
"""
