"""The thin ``VaultService`` servicer: proto -> VaultStore -> proto."""

from __future__ import annotations

import json
from typing import TypeAlias

import grpc

from berth.environment.v1 import vault_pb2, vault_service_pb2 as pb, vault_service_pb2_grpc
from services.core.context import current_org
from services.environment.models import VaultCredentialRow, VaultRow
from services.environment.servicer import _timestamp
from services.environment.secret_sync import SandboxSecretSync
from services.environment.vaults import UNSET, CredentialRotation, SecretInput, VaultListPage, VaultStore

__all__ = ["VaultServicer"]

_Context: TypeAlias = grpc.aio.ServicerContext


def _vault(row: VaultRow) -> vault_pb2.Vault:
    vault = vault_pb2.Vault(
        id=row.id, org_id=row.org_id, metadata=json.loads(row.metadata_json), create_time=_timestamp(row.create_time)
    )
    if row.name is not None:
        vault.name = row.name
    return vault


def _credential(row: VaultCredentialRow) -> vault_pb2.Credential:
    return vault_pb2.Credential(
        id=row.id,
        vault_id=row.vault_id,
        name=row.name,
        metadata=json.loads(row.metadata_json),
        auth=vault_pb2.CredentialAuth.FromString(row.auth),
        create_time=_timestamp(row.create_time),
        update_time=_timestamp(row.update_time),
    )


def _page(page: pb.VaultPage) -> VaultListPage:
    return VaultListPage(
        limit=page.limit, after=page.after, order=page.order, metadata=dict(page.metadata), statuses=list(page.statuses)
    )


def _secret(secret: vault_pb2.CredentialSecret) -> SecretInput:
    return SecretInput(
        value=secret.value if secret.HasField("value") else None,
        refresh_token=secret.refresh_token if secret.HasField("refresh_token") else None,
        client_secret=secret.client_secret if secret.HasField("client_secret") else None,
    )


class VaultServicer(vault_service_pb2_grpc.VaultServiceServicer):
    def __init__(self, store: VaultStore, sync: SandboxSecretSync | None = None) -> None:
        """``sync`` takes rotations and deletions to running sandboxes;
        without it (no compute) they apply to new sandboxes only."""
        self._store = store
        self._sync = sync

    async def CreateVault(self, request: pb.CreateVaultRequest, context: _Context) -> pb.CreateVaultResponse:
        name = request.name if request.HasField("name") else None
        row = await self._store.create_vault(current_org(), name=name, metadata=dict(request.metadata))
        return pb.CreateVaultResponse(vault=_vault(row))

    async def GetVault(self, request: pb.GetVaultRequest, context: _Context) -> pb.GetVaultResponse:
        return pb.GetVaultResponse(vault=_vault(await self._store.get_vault(current_org(), request.vault_id)))

    async def UpdateVault(self, request: pb.UpdateVaultRequest, context: _Context) -> pb.UpdateVaultResponse:
        name = (request.name if request.HasField("name") else None) if request.update_name else UNSET
        row = await self._store.update_vault(
            current_org(),
            request.vault_id,
            name=name,
            metadata=dict(request.metadata) if request.update_metadata else None,
        )
        return pb.UpdateVaultResponse(vault=_vault(row))

    async def ListVaults(self, request: pb.ListVaultsRequest, context: _Context) -> pb.ListVaultsResponse:
        rows, has_more = await self._store.list_vaults(current_org(), _page(request.page))
        return pb.ListVaultsResponse(vaults=[_vault(r) for r in rows], has_more=has_more)

    async def DeleteVault(self, request: pb.DeleteVaultRequest, context: _Context) -> pb.DeleteVaultResponse:
        if self._sync is not None:
            await self._sync.delete_vault(current_org(), request.vault_id)
        else:
            await self._store.delete_vault(current_org(), request.vault_id)
        return pb.DeleteVaultResponse(vault_id=request.vault_id)

    async def CreateCredential(
        self, request: pb.CreateCredentialRequest, context: _Context
    ) -> pb.CreateCredentialResponse:
        row = await self._store.create_credential(
            current_org(),
            request.vault_id,
            name=request.name,
            metadata=dict(request.metadata),
            auth=request.auth,
            secret=_secret(request.secret),
        )
        return pb.CreateCredentialResponse(credential=_credential(row))

    async def GetCredential(self, request: pb.GetCredentialRequest, context: _Context) -> pb.GetCredentialResponse:
        row = await self._store.get_credential(current_org(), request.vault_id, request.credential_id)
        return pb.GetCredentialResponse(credential=_credential(row))

    async def UpdateCredential(
        self, request: pb.UpdateCredentialRequest, context: _Context
    ) -> pb.UpdateCredentialResponse:
        rotation = None
        if request.rotate_type:
            expires_at = (
                (request.expires_at if request.HasField("expires_at") else None) if request.update_expires_at else UNSET
            )
            scope = (request.scope if request.HasField("scope") else None) if request.update_scope else UNSET
            rotation = CredentialRotation(
                type=request.rotate_type,
                secret=_secret(request.secret),
                expires_at=expires_at,
                refresh=request.rotate_refresh,
                scope=scope,
                token_endpoint_auth_type=request.rotate_token_endpoint_auth_type,
            )
        row = await self._store.update_credential(
            current_org(),
            request.vault_id,
            request.credential_id,
            metadata=dict(request.metadata) if request.update_metadata else None,
            rotation=rotation,
        )
        if rotation is not None and self._sync is not None:
            await self._sync.credential_rotated(current_org(), request.vault_id, row.auth_type)
        return pb.UpdateCredentialResponse(credential=_credential(row))

    async def ListCredentials(
        self, request: pb.ListCredentialsRequest, context: _Context
    ) -> pb.ListCredentialsResponse:
        rows, has_more = await self._store.list_credentials(current_org(), request.vault_id, _page(request.page))
        return pb.ListCredentialsResponse(credentials=[_credential(r) for r in rows], has_more=has_more)

    async def DeleteCredential(
        self, request: pb.DeleteCredentialRequest, context: _Context
    ) -> pb.DeleteCredentialResponse:
        if self._sync is not None:
            await self._sync.delete_credential(current_org(), request.vault_id, request.credential_id)
        else:
            await self._store.delete_credential(current_org(), request.vault_id, request.credential_id)
        return pb.DeleteCredentialResponse(credential_id=request.credential_id)

    async def CheckVaults(self, request: pb.CheckVaultsRequest, context: _Context) -> pb.CheckVaultsResponse:
        await self._store.check_vaults(current_org(), list(request.vault_ids), param=request.param or "vault_ids")
        return pb.CheckVaultsResponse()

    async def ResolveMcpCredential(
        self, request: pb.ResolveMcpCredentialRequest, context: _Context
    ) -> pb.ResolveMcpCredentialResponse:
        authorization, credential_id = await self._store.resolve_mcp(
            current_org(), list(request.vault_ids), credential_id=request.credential_id, server_url=request.server_url
        )
        return pb.ResolveMcpCredentialResponse(authorization=authorization, credential_id=credential_id)
