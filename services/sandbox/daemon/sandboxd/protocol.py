"""What crosses sandboxd's socket: frames, errors and request fields.

The host-side client (``services/sandbox/daemon_client.py``) imports this
module too, so both ends read and write frames with the same code. It has no
side effects on import and uses the standard library alone.
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import sys
from typing import Any, Awaitable, Callable, Dict, List, Optional, Protocol

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 96 * 1024 * 1024
MAX_WRITE_BYTES = 64 * 1024 * 1024
# The most data one chunk frame carries.
MAX_READ_CHUNK = 1024 * 1024

_LENGTH = struct.Struct(">I")
Json = Dict[str, Any]


def log(message: str) -> None:
    sys.stderr.write("sandboxd: %s\n" % message)
    sys.stderr.flush()


class OpError(Exception):
    """A failed request. ``reason`` refines ``code`` for callers that act on
    it (e.g. ``mcp_server_dead``); ``param`` names the offending field."""

    def __init__(self, code: str, message: str, reason: Optional[str] = None, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason
        self.param = param

    def frame(self) -> Json:
        error: Json = {"code": self.code, "message": self.message}
        if self.reason is not None:
            error["reason"] = self.reason
        if self.param is not None:
            error["param"] = self.param
        return error


class ProtocolError(Exception):
    """A malformed frame: the connection cannot continue."""


class Sender(Protocol):
    """Where an op sends the frames it streams before its final one."""

    async def send(self, frame: Json) -> None: ...


# An op: (connection, request id, request) -> the final frame's fields.
Handler = Callable[[Sender, int, Json], Awaitable[Json]]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(value: Any, field: str) -> bytes:
    if not isinstance(value, str):
        raise OpError("invalid_argument", "%s must be a base64 string" % field)
    try:
        return base64.b64decode(value, validate=True)
    except ValueError:
        raise OpError("invalid_argument", "%s is not valid base64" % field) from None


def encode_frame(obj: Json) -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode("utf-8")
    return _LENGTH.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> Optional[Json]:
    """Returns None on a clean end of stream between frames."""
    try:
        header = await reader.readexactly(_LENGTH.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise ProtocolError("truncated frame header") from None
    (length,) = _LENGTH.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise ProtocolError("frame of %d bytes exceeds the %d byte limit" % (length, MAX_FRAME_BYTES))
    try:
        body = await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise ProtocolError("truncated frame") from None
    try:
        obj = json.loads(body.decode("utf-8"))
    except ValueError:
        raise ProtocolError("frame is not UTF-8 JSON") from None
    if not isinstance(obj, dict):
        raise ProtocolError("frame is not a JSON object")
    return obj


# ---------------------------------------------------------------- request fields
# Typed reads of a request's fields; a wrong type is invalid_argument.


def opt_str(req: Json, key: str) -> Optional[str]:
    value = req.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise OpError("invalid_argument", "%s must be a string" % key)
    return value


def req_str(req: Json, key: str) -> str:
    value = opt_str(req, key)
    if value is None or value == "":
        raise OpError("invalid_argument", "%s is required" % key)
    return value


def opt_bool(req: Json, key: str, default: bool) -> bool:
    value = req.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise OpError("invalid_argument", "%s must be a boolean" % key)
    return value


def opt_int(req: Json, key: str, default: Optional[int]) -> Optional[int]:
    value = req.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise OpError("invalid_argument", "%s must be an integer" % key)
    return value


def _opt_float(req: Json, key: str, minimum: float, inclusive: bool) -> Optional[float]:
    value = req.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value == float("inf"):
        raise OpError("invalid_argument", "%s must be a finite number" % key, param=key)
    if value < minimum or (value == minimum and not inclusive):
        qualifier = "positive" if not inclusive else "non-negative"
        raise OpError("invalid_argument", "%s must be a %s number" % (key, qualifier), param=key)
    return float(value)


def opt_positive_float(req: Json, key: str) -> Optional[float]:
    return _opt_float(req, key, 0.0, inclusive=False)


def opt_non_negative_float(req: Json, key: str) -> Optional[float]:
    return _opt_float(req, key, 0.0, inclusive=True)


def opt_env(req: Json) -> Dict[str, str]:
    value = req.get("env")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise OpError("invalid_argument", "env must be an object")
    env: Dict[str, str] = {}
    for key, item in value.items():
        if not isinstance(item, str) or not key or "=" in key or "\0" in key or "\0" in item:
            raise OpError("invalid_argument", "env entries must be NAME: string")
        env[key] = item
    return env


def str_list(value: Any, field: str) -> List[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) and "\0" not in v for v in value):
        raise OpError("invalid_argument", "%s must be a list of strings" % field, param=field)
    return list(value)


def str_dict(value: Any, field: str) -> Dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise OpError("invalid_argument", "%s must be an object of strings" % field, param=field)
    return dict(value)
