"""Organizations and API keys: the domain functions behind ``berth keys`` and
the gateway's authentication.

A key is ``sk-berth-`` plus 43 URL-safe characters. It is shown once, when it
is created; the database keeps only its SHA-256 and a short prefix for
listing. Scopes are ``tasks:read`` and ``tasks:write``; the Rebyte names
``api.agents.read`` / ``api.agents.write`` are accepted and normalized.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import bindparam, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.models import ApiKeyRow, OrganizationRow
from services.core.db import Database, open_database
from services.core.errors import InvalidArgument, NotFound
from services.core.ids import new_id
from services.core.settings import Settings

__all__ = [
    "KEY_PREFIX",
    "SCOPE_READ",
    "SCOPE_WRITE",
    "ALL_SCOPES",
    "Org",
    "KeyRecord",
    "AuthenticatedKey",
    "normalize_scopes",
    "hash_key",
    "open_gateway_database",
    "create_org",
    "create_key",
    "list_keys",
    "revoke_key",
    "ensure_dev_key",
    "authenticate_key",
]

KEY_PREFIX = "sk-berth-"
SCOPE_READ = "tasks:read"
SCOPE_WRITE = "tasks:write"
ALL_SCOPES: tuple[str, ...] = (SCOPE_READ, SCOPE_WRITE)
_SCOPE_ALIASES = {"api.agents.read": SCOPE_READ, "api.agents.write": SCOPE_WRITE}
_DISPLAY_PREFIX_LEN = 16
# last_used_at is advisory; refreshing it at most once a minute keeps most
# authenticated requests free of a write.
_LAST_USED_RESOLUTION_S = 60.0

MIGRATIONS = Path(__file__).parent / "migrations" / "versions"


@dataclass(frozen=True)
class Org:
    id: str
    name: str
    created_at: float


@dataclass(frozen=True)
class KeyRecord:
    id: str
    org_id: str
    org_name: str
    name: str | None
    scopes: tuple[str, ...]
    prefix: str
    created_at: float
    last_used_at: float | None
    revoked_at: float | None

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None


@dataclass(frozen=True)
class AuthenticatedKey:
    key_id: str
    org_id: str
    scopes: frozenset[str]


def normalize_scopes(scopes: Iterable[str]) -> tuple[str, ...]:
    """Maps aliases to canonical scopes, drops duplicates, rejects unknown ones."""
    out: list[str] = []
    for raw in scopes:
        scope = _SCOPE_ALIASES.get(raw.strip(), raw.strip())
        if scope not in ALL_SCOPES:
            raise InvalidArgument(f"unknown scope {raw!r}; use tasks:read or tasks:write", param="scopes")
        if scope not in out:
            out.append(scope)
    if not out:
        raise InvalidArgument("a key needs at least one scope", param="scopes")
    return tuple(out)


def hash_key(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode()).hexdigest()


async def open_gateway_database(settings: Settings) -> Database:
    """The gateway's database, migrated to head (also used by the CLI)."""
    return await open_database(settings.database_url("gateway"), "gateway", MIGRATIONS, pool=settings.database_pool())


def _org(row: OrganizationRow) -> Org:
    return Org(id=row.id, name=row.name, created_at=row.created_at)


def _record(row: ApiKeyRow, org_name: str) -> KeyRecord:
    return KeyRecord(
        id=row.id,
        org_id=row.org_id,
        org_name=org_name,
        name=row.name,
        scopes=tuple(json.loads(row.scopes_json)),
        prefix=row.prefix,
        created_at=row.created_at,
        last_used_at=row.last_used_at,
        revoked_at=row.revoked_at,
    )


async def _org_by_name(s: AsyncSession, name: str) -> OrganizationRow | None:
    return (await s.execute(select(OrganizationRow).where(OrganizationRow.name == name))).scalar_one_or_none()


async def create_org(db: Database, name: str) -> Org:
    """Returns the organization called ``name``, creating it if needed."""
    name = name.strip()
    if not name:
        raise InvalidArgument("organization name must not be empty", param="name")
    async with db.transaction() as s:
        existing = await _org_by_name(s, name)
        if existing is not None:
            return _org(existing)
    try:
        async with db.transaction() as s:
            row = OrganizationRow(id=new_id("org"), name=name, created_at=time.time())
            s.add(row)
        return _org(row)
    except IntegrityError:
        # Another writer created it between our read and insert.
        async with db.transaction() as s:
            existing = await _org_by_name(s, name)
            if existing is None:
                raise
            return _org(existing)


async def _insert_key(s: AsyncSession, org: OrganizationRow, scopes: Sequence[str], name: str | None) -> tuple[KeyRecord, str]:
    plaintext = KEY_PREFIX + secrets.token_urlsafe(32)
    row = ApiKeyRow(
        id=new_id("key"),
        org_id=org.id,
        name=name,
        scopes_json=json.dumps(list(scopes)),
        prefix=plaintext[:_DISPLAY_PREFIX_LEN],
        key_hash=hash_key(plaintext),
        created_at=time.time(),
    )
    s.add(row)
    await s.flush()
    return _record(row, org.name), plaintext


async def create_key(
    db: Database, org_name: str, scopes: Iterable[str], name: str | None = None
) -> tuple[KeyRecord, str]:
    """Creates a key for ``org_name`` (creating the org if needed). Returns the
    record and the plaintext, which is never available again."""
    canonical = normalize_scopes(scopes)
    await create_org(db, org_name)
    async with db.transaction() as s:
        org = await _org_by_name(s, org_name.strip())
        if org is None:  # pragma: no cover - created just above
            raise NotFound(f"organization {org_name!r} not found")
        return await _insert_key(s, org, canonical, name)


async def list_keys(db: Database, org_name: str | None = None) -> list[KeyRecord]:
    """All keys (revoked ones included), oldest first, optionally of one org."""
    async with db.transaction() as s:
        stmt = select(ApiKeyRow, OrganizationRow.name).join(OrganizationRow, OrganizationRow.id == ApiKeyRow.org_id)
        if org_name is not None:
            stmt = stmt.where(OrganizationRow.name == org_name)
        rows = (await s.execute(stmt.order_by(ApiKeyRow.id))).all()
        return [_record(row, org) for row, org in rows]


async def revoke_key(db: Database, key_id_or_prefix: str) -> KeyRecord:
    """Revokes the key with this ID, or the one key whose display prefix
    starts with this value. Revoking twice keeps the first revocation time."""
    value = key_id_or_prefix.strip()
    if not value:
        raise InvalidArgument("a key ID or prefix is required", param="key")
    async with db.transaction() as s:
        stmt = select(ApiKeyRow, OrganizationRow.name).join(OrganizationRow, OrganizationRow.id == ApiKeyRow.org_id)
        if value.startswith("key_"):
            rows = (await s.execute(stmt.where(ApiKeyRow.id == value))).all()
        else:
            # A partial prefix, the full display prefix, or the whole key.
            wanted = value[:_DISPLAY_PREFIX_LEN]
            rows = (await s.execute(stmt.where(ApiKeyRow.prefix.startswith(wanted, autoescape=True)))).all()
        if not rows:
            raise NotFound(f"no key matches {value!r}")
        if len(rows) > 1:
            raise InvalidArgument(f"{len(rows)} keys match {value!r}; use the key ID", param="key")
        row, org_name = rows[0]
        if row.revoked_at is None:
            row.revoked_at = time.time()
        await s.flush()
        return _record(row, org_name)


async def ensure_dev_key(db: Database, org_name: str) -> str | None:
    """Creates ``org_name`` and a full-scope key if that org has no key yet.
    Returns the plaintext only when a key was created now."""
    org = await create_org(db, org_name)
    async with db.transaction() as s:
        has_key = (await s.execute(select(ApiKeyRow.id).where(ApiKeyRow.org_id == org.id).limit(1))).first()
        if has_key is not None:
            return None
        row = await _org_by_name(s, org.name)
        assert row is not None
        _, plaintext = await _insert_key(s, row, ALL_SCOPES, "dev")
        return plaintext


# Built once: every request runs it, and building costs more than running.
_KEY_BY_HASH = select(ApiKeyRow).where(ApiKeyRow.key_hash == bindparam("key_hash"))


async def authenticate_key(db: Database, plaintext: str) -> AuthenticatedKey | None:
    """The key's org and scopes, or None for an unknown or revoked key. Looked
    up on every request, so a revocation takes effect immediately."""
    if not plaintext.startswith(KEY_PREFIX):
        return None
    digest = hash_key(plaintext)
    now = time.time()

    async def lookup(s: AsyncSession) -> ApiKeyRow | None:
        return (await s.execute(_KEY_BY_HASH, {"key_hash": digest})).scalar_one_or_none()

    # A run, not a bare transaction: a lookup that lost its connection (a
    # database restart) is tried once more instead of failing the request.
    row = await db.run(lookup, read_only=True)
    if row is None or not hmac.compare_digest(row.key_hash, digest) or row.revoked_at is not None:
        return None
    key = AuthenticatedKey(key_id=row.id, org_id=row.org_id, scopes=frozenset(json.loads(row.scopes_json)))
    if row.last_used_at is None or row.last_used_at < now - _LAST_USED_RESOLUTION_S:
        async with db.transaction() as s:
            await s.execute(
                update(ApiKeyRow)
                .where(ApiKeyRow.id == key.key_id, ApiKeyRow.revoked_at.is_(None))
                .values(last_used_at=now)
            )
    return key
