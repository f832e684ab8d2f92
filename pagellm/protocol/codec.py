"""The one encoder/decoder pair for everything on a socket: msgspec msgpack, no pickle.

Decoders are typed, so a malformed or hostile message fails in `decode` with a
`msgspec.ValidationError` naming the offending field instead of surfacing later as an
AttributeError deep inside the scheduler.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

T = TypeVar("T")


class MsgpackEncoder:
    """Encodes any protocol Struct; `encode_into` reuses one buffer on hot paths."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, obj: Any) -> bytes:
        return self._encoder.encode(obj)

    def encode_into(self, obj: Any, buffer: bytearray) -> None:
        self._encoder.encode_into(obj, buffer)


class MsgpackDecoder(Generic[T]):
    """Decodes bytes into one expected type."""

    def __init__(self, type_: type[T]) -> None:
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(type_)

    def decode(self, data: bytes | bytearray | memoryview) -> T:
        return self._decoder.decode(data)
