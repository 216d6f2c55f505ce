"""The contract between the parts: what crosses from the front end to the engine, from the
engine to the model, and back.

The step plan, sampling parameters, request outputs, errors and the messages between the API
process and the engine process live here, in plain data that serialises. The engine and the
model both import this package; neither imports the other for these, so the model package
depends on nothing of the engine's.
"""
