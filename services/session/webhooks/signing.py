"""Signing secrets: created, kept encrypted at rest, and used to sign.

Signatures follow Standard Webhooks (the convention OpenAI's webhooks and
``client.webhooks.verify_signature`` use): a secret ``whsec_<base64 key>``,
and ``webhook-signature: v1,<base64 HMAC-SHA256(key, "<id>.<timestamp>.<body>")>``.
The secret must be usable to sign, so it is encrypted (Fernet), not hashed;
the keys come from ``BERTH_WEBHOOK_SECRET_KEY`` (newest first; older ones
still decrypt), a file, or a key file created under the data directory on
first use.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from pathlib import Path

from services.core.key_ring import KeyRing
from services.core.settings import Settings

__all__ = ["SecretBox", "new_secret", "secret_hint", "signature", "signed_headers", "open_secret_box"]

_PREFIX = "whsec_"


def new_secret() -> str:
    return _PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def secret_hint(secret: str) -> str:
    return f"{_PREFIX}...{secret[-4:]}"


def signature(secret: str, message_id: str, timestamp: int, body: bytes) -> str:
    key = base64.b64decode(secret.removeprefix(_PREFIX))
    signed = f"{message_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()


def signed_headers(secret: str, message_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    return {
        "webhook-id": message_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": signature(secret, message_id, timestamp, body),
    }


class SecretBox:
    """Encrypts signing secrets for the database and decrypts them to sign
    (with any key of the ring, so the key rotates: services/core/key_ring.py)."""

    def __init__(self, ring: KeyRing) -> None:
        self._ring = ring

    def seal(self, secret: str) -> str:
        return self._ring.encrypt(secret.encode()).decode()

    def open(self, sealed: str) -> str:
        return self._ring.decrypt(sealed.encode()).decode()


def open_secret_box(settings: Settings) -> SecretBox:
    file = Path(settings.webhook_secret_key_file) if settings.webhook_secret_key_file else None
    return SecretBox(
        KeyRing.load(settings.webhook_secret_key.get_secret_value(), file, settings.data_dir.resolve() / "webhook_secret.key")
    )
