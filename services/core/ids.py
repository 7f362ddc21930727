"""Prefixed, time-ordered identifiers.

IDs sort by creation time (a millisecond timestamp leads the random part), so
cursor pagination can order by ID alone, on SQLite and PostgreSQL alike.
"""

from __future__ import annotations

import secrets
import time
from typing import Final, Literal

__all__ = ["Prefix", "new_id", "has_prefix"]

Prefix = Literal[
    "env", "sess", "turn", "item", "art", "file", "agent", "sbx", "org", "key", "evt", "call", "proc", "idem"
]

_ALPHABET: Final = "0123456789abcdefghijklmnopqrstuvwxyz"


def _encode(value: int, width: int) -> str:
    out = []
    for _ in range(width):
        value, rem = divmod(value, 36)
        out.append(_ALPHABET[rem])
    return "".join(reversed(out))


def new_id(prefix: Prefix) -> str:
    """Returns ``<prefix>_<9 time chars><16 random chars>``; ``file`` uses ``file-``
    as the OpenAI Files API does."""
    body = _encode(time.time_ns() // 1_000_000, 9) + _encode(secrets.randbits(82), 16)
    sep = "-" if prefix == "file" else "_"
    return f"{prefix}{sep}{body}"


def has_prefix(value: str, prefix: Prefix) -> bool:
    sep = "-" if prefix == "file" else "_"
    head = f"{prefix}{sep}"
    return value.startswith(head) and len(value) == len(head) + 25 and all(c in _ALPHABET for c in value[len(head):])
