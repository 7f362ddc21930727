"""Encryption at rest of the secrets Berth must be able to read back (vault
credentials, webhook signing secrets): Fernet (AES-128-CBC with
HMAC-SHA256) through ``cryptography``'s MultiFernet, so keys rotate.

The first key encrypts; every key decrypts. Rotation is adding a new key in
front and restarting; an owner that records ``key_id`` beside each
ciphertext re-encrypts only the stale rows (``rotate``), after which the old
key can be removed. A key ID is a short digest of the key.

Keys come from a setting (comma- or newline-separated, newest first), else a
file named by a setting, else a file created under the data dir on first
start (0600, exclusively, so a concurrent first start keeps the first key).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken, MultiFernet

from services.core.logging import get_logger

__all__ = ["KeyRing", "InvalidToken"]

log = get_logger(__name__)


def _key_id(key: bytes) -> str:
    return hashlib.sha256(key).hexdigest()[:16]


class KeyRing:
    def __init__(self, keys: Sequence[bytes]) -> None:
        if not keys:
            raise ValueError("at least one encryption key is required")
        try:
            self._fernet = MultiFernet([Fernet(k) for k in keys])
        except ValueError as exc:
            # The message names no key material.
            raise ValueError("an encryption key is not a valid Fernet key (32 url-safe base64-encoded bytes)") from exc
        self.key_id = _key_id(keys[0])

    @classmethod
    def load(cls, value: str, file: Path | None, default_file: Path) -> KeyRing:
        """Keys from ``value``, else ``file``, else ``default_file``, created
        with one new key when it does not exist."""
        if value.strip():
            return cls(_split(value.replace(",", "\n")))
        if file is not None:
            return cls(_split(file.read_text()))
        if not default_file.exists():
            _create_key_file(default_file)
        return cls(_split(default_file.read_text()))

    def encrypt(self, plaintext: bytes) -> bytes:
        return self._fernet.encrypt(plaintext)

    def decrypt(self, token: bytes) -> bytes:
        """Raises ``InvalidToken`` when no configured key made ``token``."""
        return self._fernet.decrypt(token)

    def rotate(self, token: bytes) -> bytes:
        """``token`` re-encrypted with the first key."""
        return self._fernet.rotate(token)


def _split(text: str) -> list[bytes]:
    return [line.strip().encode() for line in text.splitlines() if line.strip()]


def _create_key_file(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return  # a concurrent first start made it
    with os.fdopen(fd, "wb") as f:
        f.write(Fernet.generate_key() + b"\n")
    log.info("key_file_created", path=str(path))
