"""Vaults and their credentials: ``/v1/vaults`` (the SDK's
``client.beta.agents.vaults``; updates are POSTs, as the SDK sends them).
Secret values go in and never come out."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi import Query, Request
from fastapi.responses import Response

from berth.environment.v1 import vault_pb2, vault_service_pb2 as pb
from gateway import render
from gateway.errors import ApiError
from gateway.idempotency import IdempotencyDep
from gateway.routes._common import body_hash, json_response, read_json, require_id, v1_router
from gateway.state import VaultStubDep
from gateway.validation import validate_body
from gateway.vault_validation import (
    CredentialCreateBody,
    CredentialUpdateBody,
    VaultCreateBody,
    VaultUpdateBody,
    _RotateEnvironmentVariable,
    _RotateMcpOauth,
    _RotateRefresh,
    _RotateStaticBearer,
)

__all__ = ["router"]

router = v1_router()


def _list_page(
    request: Request, after: str | None, limit: int, order: str
) -> pb.VaultPage:
    """The list query: ``metadata[key]=value`` pairs and ``status`` or
    ``status[]`` (one or several), as the SDK encodes them."""
    query = request.query_params
    metadata = {k[len("metadata[") : -1]: v for k, v in query.multi_items() if k.startswith("metadata[") and k.endswith("]")}
    if len(metadata) > 16:
        raise ApiError(400, "validation_error", "At most 16 metadata filters are allowed.", param="metadata")
    statuses = query.getlist("status") + query.getlist("status[]")
    for status in statuses:
        if status not in ("active", "archived"):
            raise ApiError(400, "validation_error", "Invalid 'status': must be active or archived.", param="status")
    return pb.VaultPage(limit=limit, after=after or "", order=order, metadata=metadata, statuses=statuses)


_SECRET_FIELDS = frozenset({"token", "access_token", "secret_value", "refresh_token", "client_secret"})


def _without_secrets(value: Any) -> Any:
    """The body as the idempotency record hashes it: no secret, nor a digest
    of one, is stored. A retry under the same key with another secret
    replays the first answer."""
    if isinstance(value, dict):
        return {k: _without_secrets(v) for k, v in value.items() if k not in _SECRET_FIELDS}
    if isinstance(value, list):
        return [_without_secrets(v) for v in value]
    return value


_After = Annotated[str | None, Query()]
_Limit = Annotated[int, Query(ge=1, le=100)]
_Order = Annotated[Literal["asc", "desc"], Query()]


@router.post("/vaults")
async def create_vault(request: Request, stub: VaultStubDep, idempotency: IdempotencyDep) -> Response:
    body = await read_json(request)
    parsed = validate_body(VaultCreateBody, body.data)
    message = pb.CreateVaultRequest(metadata=parsed.metadata or {})
    if parsed.name is not None:
        message.name = parsed.name
    async with idempotency.begin(body.hash) as idem:
        if idem.replay is not None:
            return idem.replay.to_response()
        response = await stub.CreateVault(message)
        content = render.vault(response.vault)
        await idem.store(200, json.dumps(content))
        return json_response(content)


@router.get("/vaults")
async def list_vaults(
    request: Request, stub: VaultStubDep, after: _After = None, limit: _Limit = 20, order: _Order = "desc"
) -> dict[str, Any]:
    response = await stub.ListVaults(pb.ListVaultsRequest(page=_list_page(request, after, limit, order)))
    return render.cursor_page([render.vault(v) for v in response.vaults], response.has_more)


@router.get("/vaults/{vault_id}")
async def retrieve_vault(vault_id: str, stub: VaultStubDep) -> dict[str, Any]:
    response = await stub.GetVault(pb.GetVaultRequest(vault_id=require_id(vault_id, "vault")))
    return render.vault(response.vault)


@router.post("/vaults/{vault_id}")
async def update_vault(vault_id: str, request: Request, stub: VaultStubDep) -> dict[str, Any]:
    require_id(vault_id, "vault")
    data = (await read_json(request)).data
    parsed = validate_body(VaultUpdateBody, data)
    message = pb.UpdateVaultRequest(vault_id=vault_id, update_name="name" in data, update_metadata="metadata" in data)
    if parsed.name is not None:
        message.name = parsed.name
    if parsed.metadata is not None:
        message.metadata.update(parsed.metadata)
    response = await stub.UpdateVault(message)
    return render.vault(response.vault)


@router.delete("/vaults/{vault_id}")
async def delete_vault(vault_id: str, stub: VaultStubDep) -> dict[str, Any]:
    response = await stub.DeleteVault(pb.DeleteVaultRequest(vault_id=require_id(vault_id, "vault")))
    return render.deleted(response.vault_id or vault_id, "vault.deleted")


@router.post("/vaults/{vault_id}/credentials")
async def create_credential(
    vault_id: str, request: Request, stub: VaultStubDep, idempotency: IdempotencyDep
) -> Response:
    require_id(vault_id, "vault")
    body = await read_json(request)
    parsed = validate_body(CredentialCreateBody, body.data)
    auth, secret = parsed.auth.to_proto()
    message = pb.CreateCredentialRequest(
        vault_id=vault_id, name=parsed.name, metadata=parsed.metadata or {}, auth=auth, secret=secret
    )
    async with idempotency.begin(body_hash({"vault_id": vault_id, **_without_secrets(body.data)})) as idem:
        if idem.replay is not None:
            return idem.replay.to_response()
        response = await stub.CreateCredential(message)
        content = render.vault_credential(response.credential)
        await idem.store(200, json.dumps(content))
        return json_response(content)


@router.get("/vaults/{vault_id}/credentials")
async def list_credentials(
    vault_id: str,
    request: Request,
    stub: VaultStubDep,
    after: _After = None,
    limit: _Limit = 20,
    order: _Order = "desc",
) -> dict[str, Any]:
    require_id(vault_id, "vault")
    response = await stub.ListCredentials(
        pb.ListCredentialsRequest(vault_id=vault_id, page=_list_page(request, after, limit, order))
    )
    return render.cursor_page([render.vault_credential(c) for c in response.credentials], response.has_more)


@router.get("/vaults/{vault_id}/credentials/{credential_id}")
async def retrieve_credential(vault_id: str, credential_id: str, stub: VaultStubDep) -> dict[str, Any]:
    response = await stub.GetCredential(
        pb.GetCredentialRequest(vault_id=require_id(vault_id, "vault"), credential_id=require_id(credential_id, "vcred"))
    )
    return render.vault_credential(response.credential)


@router.post("/vaults/{vault_id}/credentials/{credential_id}")
async def update_credential(vault_id: str, credential_id: str, request: Request, stub: VaultStubDep) -> dict[str, Any]:
    message = pb.UpdateCredentialRequest(
        vault_id=require_id(vault_id, "vault"), credential_id=require_id(credential_id, "vcred")
    )
    data = (await read_json(request)).data
    parsed = validate_body(CredentialUpdateBody, data)
    if parsed.metadata is not None:
        message.update_metadata = True
        message.metadata.update(parsed.metadata)
    auth = parsed.auth
    if auth is not None:
        message.rotate_type = auth.type
        if isinstance(auth, _RotateStaticBearer):
            message.secret.value = auth.token
        elif isinstance(auth, _RotateMcpOauth):
            if auth.access_token is not None:
                message.secret.value = auth.access_token
            if auth.refresh is not None:
                _rotate_refresh(message, auth.refresh, data["auth"]["refresh"])
            message.update_expires_at = "expires_at" in data["auth"]
            if auth.expires_at is not None:
                message.expires_at = auth.expires_at
        elif isinstance(auth, _RotateEnvironmentVariable):
            message.secret.value = auth.secret_value
        else:
            message.secret.CopyFrom(vault_pb2.CredentialSecret())
    response = await stub.UpdateCredential(message)
    return render.vault_credential(response.credential)


def _rotate_refresh(message: pb.UpdateCredentialRequest, refresh: _RotateRefresh, given: dict[str, Any]) -> None:
    """``auth.refresh`` of a rotation: omitted or null secrets keep the
    stored ones; an omitted scope is kept and a null one cleared."""
    message.rotate_refresh = True
    if refresh.refresh_token is not None:
        message.secret.refresh_token = refresh.refresh_token
    if refresh.token_endpoint_auth is not None:
        message.rotate_token_endpoint_auth_type = refresh.token_endpoint_auth.type
        if refresh.token_endpoint_auth.client_secret is not None:
            message.secret.client_secret = refresh.token_endpoint_auth.client_secret
    message.update_scope = "scope" in given
    if refresh.scope is not None:
        message.scope = refresh.scope


@router.delete("/vaults/{vault_id}/credentials/{credential_id}")
async def delete_credential(vault_id: str, credential_id: str, stub: VaultStubDep) -> dict[str, Any]:
    response = await stub.DeleteCredential(
        pb.DeleteCredentialRequest(
            vault_id=require_id(vault_id, "vault"), credential_id=require_id(credential_id, "vcred")
        )
    )
    return render.deleted(response.credential_id or credential_id, "vault.credential.deleted")
