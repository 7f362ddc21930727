"""User-supplied JSON (schemas, request metadata) in protobuf messages.

``google.protobuf.Struct`` stores every number as a double; reading one back
turns integral values into ``int`` again, so ``{"maxLength": 5}`` round-trips
unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from google.protobuf import json_format, struct_pb2

__all__ = ["to_struct", "from_struct", "to_value", "from_value"]


def _ints(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_ints(v) for v in value]
    return value


def to_struct(value: Mapping[str, Any]) -> struct_pb2.Struct:
    message = struct_pb2.Struct()
    message.update(value)
    return message


def from_struct(message: struct_pb2.Struct) -> dict[str, Any]:
    out: dict[str, Any] = _ints(json_format.MessageToDict(message))
    return out


def to_value(value: Any) -> struct_pb2.Value:
    message = struct_pb2.Value()
    json_format.ParseDict(value, message)
    return message


def from_value(message: struct_pb2.Value) -> Any:
    return _ints(json_format.MessageToDict(message))
