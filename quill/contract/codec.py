"""Bytes for the messages between processes: msgpack through msgspec, typed on the way in.

A message travels as a two-item array, the message's type name and its fields; the receiver
decodes the fields straight into that dataclass (msgspec validates the types as it goes), so
both sides share the definitions in quill.contract and nothing else.
"""

from __future__ import annotations

import msgspec

from quill.contract.messages import (
    AbortRequests,
    AddResult,
    EngineFailed,
    EngineInfo,
    EngineOutputs,
    EngineRequest,
    UtilityCall,
    UtilityResult,
)
from quill.contract.plan import StepPlan

MESSAGE_TYPES = (
    EngineRequest,
    AbortRequests,
    UtilityCall,
    AddResult,
    EngineOutputs,
    UtilityResult,
    EngineInfo,
    EngineFailed,
    StepPlan,
)
_BY_NAME = {t.__name__: t for t in MESSAGE_TYPES}


def _encode_hook(obj):
    raise NotImplementedError(f"cannot encode {type(obj).__name__} in a quill message")


class Codec:
    """Encodes and decodes the messages of quill.contract (one per side and thread: the
    encoder reuses a buffer)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_encode_hook)
        self._envelope = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw])
        self._decoders = {
            name: msgspec.msgpack.Decoder(t, strict=True) for name, t in _BY_NAME.items()
        }

    def encode(self, message) -> bytes:
        name = type(message).__name__
        if name not in _BY_NAME:
            raise TypeError(f"{name} is not a quill message")
        return self._encoder.encode((name, message))

    def decode(self, data: bytes):
        name, raw = self._envelope.decode(data)
        decoder = self._decoders.get(name)
        if decoder is None:
            raise ValueError(f"unknown message type {name!r}")
        return decoder.decode(raw)
