"""Queries of the vault tables. They take an ``AsyncSession`` and never commit;
every one filters by organization."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession

from services.environment.models import VaultCredentialRow, VaultRow

__all__ = [
    "get_vault",
    "existing_vault_ids",
    "list_vaults",
    "delete_vault",
    "get_credential",
    "list_credentials",
    "credentials_of",
    "delete_credential",
    "stale_credentials",
]


async def get_vault(s: AsyncSession, org_id: str, vault_id: str, *, for_update: bool = False) -> VaultRow | None:
    stmt = select(VaultRow).where(VaultRow.id == vault_id, VaultRow.org_id == org_id)
    if for_update:
        stmt = stmt.with_for_update()
    return (await s.execute(stmt)).scalar_one_or_none()


async def existing_vault_ids(s: AsyncSession, org_id: str, vault_ids: Sequence[str]) -> set[str]:
    stmt = select(VaultRow.id).where(VaultRow.org_id == org_id, VaultRow.id.in_(list(vault_ids)))
    return set((await s.execute(stmt)).scalars())


async def list_vaults(
    s: AsyncSession, org_id: str, *, after: str, descending: bool, statuses: Sequence[str], limit: int
) -> Sequence[VaultRow]:
    stmt = select(VaultRow).where(VaultRow.org_id == org_id)
    if statuses:
        stmt = stmt.where(VaultRow.status.in_(list(statuses)))
    if after:
        stmt = stmt.where(VaultRow.id < after if descending else VaultRow.id > after)
    stmt = stmt.order_by(VaultRow.id.desc() if descending else VaultRow.id.asc()).limit(limit)
    return (await s.execute(stmt)).scalars().all()


async def delete_vault(s: AsyncSession, org_id: str, vault_id: str) -> bool:
    await s.execute(
        delete(VaultCredentialRow).where(VaultCredentialRow.org_id == org_id, VaultCredentialRow.vault_id == vault_id)
    )
    result = await s.execute(delete(VaultRow).where(VaultRow.org_id == org_id, VaultRow.id == vault_id))
    return bool(result.rowcount)  # type: ignore[attr-defined]


async def get_credential(
    s: AsyncSession, org_id: str, vault_id: str, credential_id: str, *, for_update: bool = False
) -> VaultCredentialRow | None:
    stmt = select(VaultCredentialRow).where(
        VaultCredentialRow.id == credential_id,
        VaultCredentialRow.vault_id == vault_id,
        VaultCredentialRow.org_id == org_id,
    )
    if for_update:
        stmt = stmt.with_for_update()
    return (await s.execute(stmt)).scalar_one_or_none()


async def list_credentials(
    s: AsyncSession, org_id: str, vault_id: str, *, after: str, descending: bool, statuses: Sequence[str], limit: int
) -> Sequence[VaultCredentialRow]:
    stmt = select(VaultCredentialRow).where(VaultCredentialRow.org_id == org_id, VaultCredentialRow.vault_id == vault_id)
    if statuses:
        stmt = stmt.where(VaultCredentialRow.status.in_(list(statuses)))
    if after:
        stmt = stmt.where(VaultCredentialRow.id < after if descending else VaultCredentialRow.id > after)
    order = VaultCredentialRow.id.desc() if descending else VaultCredentialRow.id.asc()
    return (await s.execute(stmt.order_by(order).limit(limit))).scalars().all()


async def credentials_of(s: AsyncSession, org_id: str, vault_ids: Sequence[str]) -> Sequence[VaultCredentialRow]:
    """The credentials of the given vaults, oldest first."""
    stmt = (
        select(VaultCredentialRow)
        .where(VaultCredentialRow.org_id == org_id, VaultCredentialRow.vault_id.in_(list(vault_ids)))
        .order_by(VaultCredentialRow.id.asc())
    )
    return (await s.execute(stmt)).scalars().all()


async def delete_credential(s: AsyncSession, org_id: str, vault_id: str, credential_id: str) -> bool:
    result = await s.execute(
        delete(VaultCredentialRow).where(
            VaultCredentialRow.org_id == org_id,
            VaultCredentialRow.vault_id == vault_id,
            VaultCredentialRow.id == credential_id,
        )
    )
    return bool(result.rowcount)  # type: ignore[attr-defined]


async def stale_credentials(s: AsyncSession, key_id: str, *, limit: int) -> Sequence[VaultCredentialRow]:
    """Credentials encrypted with a key other than ``key_id`` (all orgs: the
    start-up rotation), locked for the re-encryption."""
    stmt = (
        select(VaultCredentialRow)
        .where(VaultCredentialRow.key_id != key_id)
        .order_by(VaultCredentialRow.id)
        .limit(limit)
        .with_for_update()
    )
    return (await s.execute(stmt)).scalars().all()
