"""Encryption at rest of vault secrets: Fernet (AES-128-CBC with HMAC-SHA256)
through ``cryptography``'s MultiFernet, so keys rotate.

The first key encrypts; every key decrypts. Rotation is adding a new key in
front and restarting: at start the Environment service re-encrypts every
row whose key ID is not the first key's (``VaultStore.rotate``), after
which the old key can be removed. A key ID is a short digest of the key,
stored beside each ciphertext, so rotation touches only stale rows.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken, MultiFernet

from services.core.logging import get_logger
from services.core.settings import Settings

__all__ = ["VaultCipher", "InvalidToken"]

log = get_logger(__name__)

_KEYS_FILE = "vault.keys"


def _key_id(key: bytes) -> str:
    return hashlib.sha256(key).hexdigest()[:16]


class VaultCipher:
    def __init__(self, keys: Sequence[bytes]) -> None:
        if not keys:
            raise ValueError("at least one vault key is required")
        try:
            self._fernet = MultiFernet([Fernet(k) for k in keys])
        except ValueError as exc:
            # The message names no key material.
            raise ValueError("a vault key is not a valid Fernet key (32 url-safe base64-encoded bytes)") from exc
        self.key_id = _key_id(keys[0])

    @classmethod
    def from_settings(cls, settings: Settings) -> VaultCipher:
        """Keys from ``vault_keys``, else ``vault_keys_file``, else a key file
        created under ``data_dir`` on first start (0600)."""
        raw = settings.vault_keys.get_secret_value()
        if raw.strip():
            return cls(_split(raw.replace(",", "\n")))
        if settings.vault_keys_file is not None:
            return cls(_split(settings.vault_keys_file.read_text()))
        path = settings.data_dir / _KEYS_FILE
        if not path.exists():
            _create_key_file(path)
            log.info("vault_key_file_created", path=str(path))
        return cls(_split(path.read_text()))

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
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(Fernet.generate_key() + b"\n")
