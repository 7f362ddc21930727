"""Rotating or deleting an ``environment_variable`` credential reaches the
sandboxes that already substitute it.

A sandbox's egress proxy keeps the secrets of its environment's own vaults
(``setup_steps.py`` hands them over at creation). When one of them is
rotated, or deleted with its credential or vault, every sandbox of an
environment of that organization whose ``vault_ids`` select the vault gets
the recomputed set (``UpdateSecretSubstitutions``) before the API call
returns; the Sandbox service seals it in the sandbox's row, so it holds
across restarts. A sandbox keeps its variables and placeholders: only the
values (and hosts) change, a deleted credential's placeholder stops being
substituted, and a credential added to a vault later is left for new
sandboxes (a running sandbox's environment is fixed).

Ordering, and what a failure leaves behind:
- A rotation is committed first, then pushed. A Sandbox service that does
  not answer fails the call with ``SandboxUnavailable`` (503) naming the
  environments; the new value is stored, and repeating the rotation pushes
  it again.
- A deletion is pushed first, without the credential (or vault), then
  committed, then pushed again (for a sandbox created meanwhile, with the
  secrets read before the commit). A push that fails before the commit
  fails the call and deletes nothing, so it can be repeated; by then some
  sandboxes may already have stopped substituting it, which only errs on
  the side of revoking.
A sandbox that no longer exists (or does not yet) is skipped.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.core.db import Database
from services.core.errors import SandboxUnavailable
from services.core.logging import get_logger
from services.environment import repository as repo
from services.environment.compute import Compute, SandboxRef
from services.environment.environment_secrets import secret_substitutions
from services.environment.vaults import EnvironmentSecret, VaultStore

__all__ = ["SandboxSecretSync"]

log = get_logger(__name__)

ENVIRONMENT_VARIABLE = "environment_variable"

# Sandboxes updated at once per call.
_CONCURRENCY = 8


@dataclass(frozen=True)
class _Target:
    environment_id: str
    sandbox: SandboxRef
    vault_ids: tuple[str, ...]


class SandboxSecretSync:
    """Credential and vault changes that reach running sandboxes."""

    def __init__(self, db: Database, vaults: VaultStore, compute: Compute) -> None:
        self._db = db
        self._vaults = vaults
        self._compute = compute

    async def credential_rotated(self, org_id: str, vault_id: str, auth_type: str) -> None:
        """After a rotation in ``vault_id`` committed. Other credential types
        never reach a sandbox."""
        if auth_type == ENVIRONMENT_VARIABLE:
            await self._push(org_id, vault_id)

    async def delete_credential(self, org_id: str, vault_id: str, credential_id: str) -> None:
        row = await self._vaults.get_credential(org_id, vault_id, credential_id)  # NotFound before any push
        if row.auth_type != ENVIRONMENT_VARIABLE:
            await self._vaults.delete_credential(org_id, vault_id, credential_id)
            return
        await self._push(org_id, vault_id, keep=lambda s: s.credential_id != credential_id)
        await self._vaults.delete_credential(org_id, vault_id, credential_id)
        await self._push(org_id, vault_id)

    async def delete_vault(self, org_id: str, vault_id: str) -> None:
        await self._vaults.get_vault(org_id, vault_id)
        if not await self._vaults.environment_variable_credentials(org_id, [vault_id]):
            await self._vaults.delete_vault(org_id, vault_id)
            return
        await self._push(org_id, vault_id, without_vault=True)
        await self._vaults.delete_vault(org_id, vault_id)
        await self._push(org_id, vault_id)

    async def _targets(self, org_id: str, vault_id: str) -> list[_Target]:
        async with self._db.transaction(read_only=True) as s:
            rows = await repo.sandboxed_environments(s, org_id)
        targets = []
        for row in rows:
            vault_ids = tuple(str(v) for v in json.loads(row.vault_ids_json or "[]"))
            if vault_id in vault_ids:
                targets.append(_Target(row.id, SandboxRef(row.sandbox_id, row.sandbox_node), vault_ids))
        return targets

    async def _push(
        self,
        org_id: str,
        vault_id: str,
        *,
        keep: Callable[[EnvironmentSecret], bool] = lambda _: True,
        without_vault: bool = False,
    ) -> None:
        targets = await self._targets(org_id, vault_id)
        if not targets:
            return
        limit = asyncio.Semaphore(_CONCURRENCY)

        async def one(target: _Target) -> str:
            """The environment ID when its sandbox could not be reached."""
            vault_ids = [v for v in target.vault_ids if not (without_vault and v == vault_id)]
            secrets = [s for s in await self._vaults.environment_secrets(org_id, vault_ids, distinct_names=False) if keep(s)]
            async with limit:
                try:
                    updated = await self._compute.update_secret_substitutions(target.sandbox, secret_substitutions(secrets))
                except SandboxUnavailable as exc:
                    log.warning(
                        "environment_secrets_update_failed",
                        environment_id=target.environment_id,
                        sandbox_id=target.sandbox.sandbox_id,
                        error=exc.message,
                    )
                    return target.environment_id
            if updated:
                log.info(
                    "environment_secrets_updated",
                    environment_id=target.environment_id,
                    sandbox_id=target.sandbox.sandbox_id,
                    credential_ids=[s.credential_id for s in secrets],
                )
            return ""

        failed = [e for e in await asyncio.gather(*(one(t) for t in targets)) if e]
        if failed:
            raise SandboxUnavailable(
                f"the sandboxes of environments {', '.join(failed)} could not be updated with the vault's "
                "credentials; repeat the request"
            )
