"""Request bodies of the vaults API (``/v1/vaults``), as the SDK's
``vault_*_params`` and ``vaults/credential_*_params`` types define them.
Their shape is checked here; the rules on values (name length, URLs,
secret characters) live in ``services/environment/vaults.py``."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from berth.environment.v1 import vault_pb2
from gateway.validation import Metadata, _not_null, _Strict

__all__ = [
    "VaultCreateBody",
    "VaultUpdateBody",
    "CredentialCreateBody",
    "CredentialUpdateBody",
]


class VaultCreateBody(_Strict):
    _check_name = _not_null("name")
    metadata: Metadata = None
    name: str | None = None


class VaultUpdateBody(_Strict):
    _check_metadata = _not_null("metadata")
    metadata: Metadata = None
    name: str | None = None


class _StaticBearer(_Strict):
    type: Literal["static_bearer"]
    token: str
    mcp_server_url: str

    def to_proto(self) -> tuple[vault_pb2.CredentialAuth, vault_pb2.CredentialSecret]:
        return (
            vault_pb2.CredentialAuth(type=self.type, mcp_server_url=self.mcp_server_url),
            vault_pb2.CredentialSecret(value=self.token),
        )


class _AuthNone(_Strict):
    type: Literal["none"]


class _AuthClientSecret(_Strict):
    # Required by the SDK's create types; a missing one is named by the
    # Environment service, which owns the rule for every method.
    type: Literal["client_secret_basic", "client_secret_post"]
    client_secret: str | None = None


class _Refresh(_Strict):
    client_id: str
    refresh_token: str
    token_endpoint: str
    token_endpoint_auth: Annotated[_AuthNone | _AuthClientSecret, Field(discriminator="type")]
    resource: str | None = None
    scope: str | None = None


class _McpOauth(_Strict):
    type: Literal["mcp_oauth"]
    access_token: str
    mcp_server_url: str
    expires_at: str | None = None
    refresh: _Refresh | None = None

    def to_proto(self) -> tuple[vault_pb2.CredentialAuth, vault_pb2.CredentialSecret]:
        auth = vault_pb2.CredentialAuth(type=self.type, mcp_server_url=self.mcp_server_url)
        secret = vault_pb2.CredentialSecret(value=self.access_token)
        if self.expires_at is not None:
            auth.expires_at = self.expires_at
        if self.refresh is not None:
            refresh = self.refresh
            auth.refresh.CopyFrom(
                vault_pb2.OAuthRefresh(
                    client_id=refresh.client_id,
                    token_endpoint=refresh.token_endpoint,
                    token_endpoint_auth_type=refresh.token_endpoint_auth.type,
                )
            )
            if refresh.resource is not None:
                auth.refresh.resource = refresh.resource
            if refresh.scope is not None:
                auth.refresh.scope = refresh.scope
            secret.refresh_token = refresh.refresh_token
            if isinstance(refresh.token_endpoint_auth, _AuthClientSecret):
                if refresh.token_endpoint_auth.client_secret is not None:
                    secret.client_secret = refresh.token_endpoint_auth.client_secret
        return auth, secret


class _Unrestricted(_Strict):
    type: Literal["unrestricted"]


class _Limited(_Strict):
    type: Literal["limited"]
    allowed_hosts: list[str]


class _EnvironmentVariable(_Strict):
    type: Literal["environment_variable"]
    networking: Annotated[_Unrestricted | _Limited, Field(discriminator="type")]
    secret_name: str
    secret_value: str

    def to_proto(self) -> tuple[vault_pb2.CredentialAuth, vault_pb2.CredentialSecret]:
        networking = vault_pb2.CredentialNetworking(type=self.networking.type)
        if isinstance(self.networking, _Limited):
            networking.allowed_hosts.extend(self.networking.allowed_hosts)
        return (
            vault_pb2.CredentialAuth(type=self.type, secret_name=self.secret_name, networking=networking),
            vault_pb2.CredentialSecret(value=self.secret_value),
        )


class CredentialCreateBody(_Strict):
    _check_metadata = _not_null("metadata")
    auth: Annotated[_StaticBearer | _McpOauth | _EnvironmentVariable, Field(discriminator="type")]
    name: str
    metadata: Metadata = None


class _RotateStaticBearer(_Strict):
    type: Literal["static_bearer"]
    token: str


class _RotateClientSecret(_Strict):
    type: Literal["client_secret_basic", "client_secret_post"]
    client_secret: str | None = None


class _RotateRefresh(_Strict):
    refresh_token: str | None = None
    scope: str | None = None
    token_endpoint_auth: _RotateClientSecret | None = None


class _RotateMcpOauth(_Strict):
    type: Literal["mcp_oauth"]
    access_token: str | None = None
    expires_at: str | None = None
    refresh: _RotateRefresh | None = None


class _RotateEnvironmentVariable(_Strict):
    type: Literal["environment_variable"]
    secret_value: str


class CredentialUpdateBody(_Strict):
    _check_fields = _not_null("metadata", "auth")
    auth: Annotated[
        _RotateStaticBearer | _RotateMcpOauth | _RotateEnvironmentVariable, Field(discriminator="type")
    ] | None = None
    metadata: Metadata = None
