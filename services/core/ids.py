"""Prefixed, time-ordered identifiers.

IDs sort by creation time (a millisecond timestamp leads the random part), so
cursor pagination can order by ID alone, on SQLite and PostgreSQL alike.
"""

from __future__ import annotations

import secrets
import threading
import time
from typing import Final, Literal

__all__ = ["Prefix", "new_id", "has_prefix"]

Prefix = Literal[
    "env", "sess", "turn", "item", "art", "file", "agent", "sbx", "org", "key", "evt", "call", "proc", "idem", "vault", "vcred",
    "subagent", "we", "whdel", "whw", "auto", "ainv", "envtpl",
]

_ALPHABET: Final = "0123456789abcdefghijklmnopqrstuvwxyz"


def _encode(value: int, width: int) -> str:
    out = []
    for _ in range(width):
        value, rem = divmod(value, 36)
        out.append(_ALPHABET[rem])
    return "".join(reversed(out))


_lock = threading.Lock()
_last_ms = 0
_last_rand = 0


def _next() -> tuple[int, int]:
    """Within one process IDs are strictly increasing: inside the same
    millisecond the random part is incremented instead of redrawn."""
    global _last_ms, _last_rand
    with _lock:
        now = time.time_ns() // 1_000_000
        if now <= _last_ms:
            now = _last_ms
            _last_rand += 1 + secrets.randbits(16)
        else:
            _last_rand = secrets.randbits(80)
        _last_ms = now
        return now, _last_rand


def new_id(prefix: Prefix) -> str:
    """Returns ``<prefix>_<9 time chars><16 random chars>``; ``file`` uses ``file-``
    as the OpenAI Files API does."""
    ms, rand = _next()
    body = _encode(ms, 9) + _encode(rand, 16)
    sep = "-" if prefix == "file" else "_"
    return f"{prefix}{sep}{body}"


def has_prefix(value: str, prefix: Prefix) -> bool:
    sep = "-" if prefix == "file" else "_"
    head = f"{prefix}{sep}"
    return value.startswith(head) and len(value) == len(head) + 25 and all(c in _ALPHABET for c in value[len(head):])
