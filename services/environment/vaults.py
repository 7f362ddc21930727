"""Vaults and credentials: the rules, the encrypted storage, and resolving
a credential for an MCP connection.

Secrets live only in ``secret_ciphertext`` (``KeyRing``); every other
column and every message this module returns is public. Nothing here logs a
secret, and errors never quote one.

A credential is bound to its ``mcp_server_url``: it is resolved only for a
connection to that URL, so a tool configuration cannot send it elsewhere.

An ``mcp_oauth`` credential with ``refresh`` also seals its refresh token
and client secret. Resolving it when its access token has expired, or
expires within ``_REFRESH_MARGIN_S``, first makes a refresh-token grant
(``oauth_refresh.py``) and stores the new access token, expiry and any
rotated refresh token in one transaction. A refresh token may be single
use, so one refresh runs at a time per credential: an in-process lock, and
on PostgreSQL the credential row locked (``FOR UPDATE``) across the grant,
re-read once locked, so a replica that waited finds the token fresh and
makes no grant of its own.
An ``environment_variable`` credential is resolved only for the sandbox of
an environment whose own ``vault_ids`` hold it (``environment_secrets``):
when it is created, and when the credential is rotated or deleted
(``secret_sync.py``); the Sandbox service's egress proxy substitutes it,
and the sandbox gets a placeholder.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import TypeVar
from urllib.parse import urlsplit

from sqlalchemy.ext.asyncio import AsyncSession

from berth.environment.v1 import vault_pb2
from services.core.db import Database
from services.core.addresses import is_public_address, parse_host
from services.core.errors import InvalidArgument, NotFound, OAuthRefreshFailed
from services.core.ids import has_prefix, new_id
from services.core.key_ring import KeyRing
from services.core.logging import get_logger
from services.core.settings import Settings
from services.environment import paging
from services.environment import vault_repository as repo
from services.environment.models import VaultCredentialRow, VaultRow
from services.environment.oauth_refresh import AUTH_METHODS, TokenEndpointClient, TokenGrant, TokenRequest

__all__ = [
    "VaultStore",
    "VaultListPage",
    "SecretInput",
    "CredentialRotation",
    "EnvironmentSecret",
    "normalize_url",
    "UNSET",
]

log = get_logger(__name__)

_MAX_NAME_BYTES = 256
_STATUSES = ("active", "archived")
_MCP_TYPES = ("static_bearer", "mcp_oauth")
_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
_HEADER_UNSAFE = re.compile(r"[\r\n\x00]")
_BATCH = 200
# An access token this close to its expiry is refreshed before use.
_REFRESH_MARGIN_S = 60.0
# RFC 6749 section 3.3: scope-tokens of %x21 / %x23-5B / %x5D-7E, one space apart.
_SCOPE = re.compile(r"[\x21\x23-\x5b\x5d-\x7e]+( [\x21\x23-\x5b\x5d-\x7e]+)*")
_SECRET_PARAMS = {
    "refresh_token": "auth.refresh.refresh_token",
    "client_secret": "auth.refresh.token_endpoint_auth.client_secret",
}
_ENV_TYPE = "environment_variable"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
# Variables Berth or the sandbox's tools depend on: a placeholder there would
# break the sandbox (PATH, HOME), or send its traffic or trust elsewhere.
_RESERVED_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "PWD", "LANG", "TERM", "HOSTNAME", "TMPDIR",
    "LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "PYTHONPATH", "PYTHONHOME", "NODE_OPTIONS",
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY", "FTP_PROXY",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS",
    "PIP_CERT", "GIT_SSL_CAINFO",
})  # fmt: skip
_RESERVED_PREFIXES = ("BERTH_", "REBYTE_", "CODEX_")
_MAX_ALLOWED_HOSTS = 16
_HOST_LABEL = re.compile(r"^[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?$")
_IPV4 = re.compile(r"^\d{1,3}(\.\d{1,3}){3}$")


class _Unset:
    pass


UNSET = _Unset()
"""A field the request left out (distinct from an explicit null)."""


@dataclass(frozen=True)
class SecretInput:
    value: str | None = None
    refresh_token: str | None = None
    client_secret: str | None = None


@dataclass(frozen=True)
class CredentialRotation:
    """A credential update's ``auth``: the type it names and its replacements."""

    type: str
    secret: SecretInput
    expires_at: str | None | _Unset = UNSET
    # mcp_oauth: whether ``auth.refresh`` was given, its new scope (None
    # stops sending one) and the token_endpoint_auth type it names.
    refresh: bool = False
    scope: str | None | _Unset = UNSET
    token_endpoint_auth_type: str = ""


@dataclass(frozen=True)
class EnvironmentSecret:
    """An environment_variable credential as a sandbox's egress proxy needs it."""

    credential_id: str
    secret_name: str
    value: str
    any_allowed_host: bool
    allowed_hosts: tuple[str, ...]


@dataclass(frozen=True)
class VaultListPage:
    limit: int = 20
    after: str = ""
    order: str = "desc"
    metadata: Mapping[str, str] | None = None
    statuses: Sequence[str] = ()


def _name(value: str, param: str) -> str:
    trimmed = value.strip()
    if not 1 <= len(trimmed.encode()) <= _MAX_NAME_BYTES:
        raise InvalidArgument(f"{param} must contain 1 to {_MAX_NAME_BYTES} UTF-8 bytes after trimming", param=param)
    return trimmed


def normalize_url(url: str) -> str:
    """The form two MCP server URLs are compared in: scheme and host in
    lowercase, the default port dropped, no trailing slash."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        # Matches nothing a credential was stored for (those URLs parse).
        return url
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    netloc = host if port is None or (scheme, port) in (("https", 443), ("http", 80)) else f"{host}:{port}"
    path = parts.path.rstrip("/")
    return f"{scheme}://{netloc}{path}" + (f"?{parts.query}" if parts.query else "")


def _server_url(value: str, param: str) -> str:
    try:
        parts = urlsplit(value.strip())
        _ = parts.port
    except ValueError as exc:
        raise InvalidArgument(f"{param} is not a valid URL", param=param) from exc
    host = (parts.hostname or "").lower()
    loopback_http = parts.scheme == "http" and host in _LOOPBACK_HOSTS
    if not host or (parts.scheme != "https" and not loopback_http) or parts.username or parts.password:
        raise InvalidArgument(f"{param} must be an https:// URL (http:// only on loopback) without userinfo", param=param)
    return value.strip()


def _header_secret(value: str | None, param: str) -> str:
    if not value:
        raise InvalidArgument(f"{param} is required and must not be empty", param=param)
    if _HEADER_UNSAFE.search(value):
        raise InvalidArgument(f"{param} must not contain carriage returns, newlines or NUL bytes", param=param)
    return value


def _secret_name(value: str, param: str) -> str:
    if not _ENV_NAME.match(value):
        raise InvalidArgument(
            f"{param} must be 1 to 128 ASCII letters, digits and underscores, not starting with a digit", param=param
        )
    upper = value.upper()
    if upper in _RESERVED_NAMES or upper.startswith(_RESERVED_PREFIXES):
        raise InvalidArgument(f"{param} {value} is reserved by the sandbox", param=param)
    return value


def _allowed_host(value: str, param: str) -> str:
    host = value.strip().lower()
    if _IPV4.match(host):
        if not all(int(part) <= 255 and (part == "0" or not part.startswith("0")) for part in host.split(".")):
            raise InvalidArgument(f"{param} is not a valid IPv4 address", param=param)
        return host
    labels = host.split(".")
    if not host or len(host) > 253 or not all(_HOST_LABEL.match(label) for label in labels) or labels[-1].isdigit():
        raise InvalidArgument(
            f"{param} must be a hostname or IPv4 address, without scheme, path, port or wildcard (no IPv6)",
            param=param,
        )
    return host


def _networking(networking: vault_pb2.CredentialNetworking, param: str) -> vault_pb2.CredentialNetworking:
    if networking.type == "unrestricted":
        if networking.allowed_hosts:
            raise InvalidArgument("allowed_hosts is only for limited networking", param=f"{param}.allowed_hosts")
        return vault_pb2.CredentialNetworking(type="unrestricted")
    if networking.type != "limited":
        raise InvalidArgument(f"{param}.type must be unrestricted or limited", param=f"{param}.type")
    hosts = [_allowed_host(h, f"{param}.allowed_hosts[{i}]") for i, h in enumerate(networking.allowed_hosts)]
    if not 1 <= len(hosts) <= _MAX_ALLOWED_HOSTS:
        raise InvalidArgument(
            f"{param}.allowed_hosts takes 1 to {_MAX_ALLOWED_HOSTS} hosts", param=f"{param}.allowed_hosts"
        )
    if len(set(hosts)) != len(hosts):
        raise InvalidArgument(f"{param}.allowed_hosts must be distinct", param=f"{param}.allowed_hosts")
    return vault_pb2.CredentialNetworking(type="limited", allowed_hosts=hosts)


def _expires_at(value: str, param: str) -> str:
    try:
        datetime.fromisoformat(value)
    except ValueError as exc:
        raise InvalidArgument(f"{param} must be an RFC 3339 timestamp", param=param) from exc
    return value


def _token_endpoint(value: str, param: str, *, allow_private: bool) -> str:
    """An https URL without userinfo or fragment (RFC 6749 section 3.2). A
    host that is an address must be global unless ``allow_private``; a name
    is checked each time it is resolved for a refresh."""
    try:
        parts = urlsplit(value.strip())
        _ = parts.port
    except ValueError as exc:
        raise InvalidArgument(f"{param} is not a valid URL", param=param) from exc
    if parts.scheme != "https" or not parts.hostname or parts.username is not None or parts.password is not None:
        raise InvalidArgument(f"{param} must be an https:// URL without userinfo", param=param)
    if parts.fragment:
        raise InvalidArgument(f"{param} must not have a fragment", param=param)
    host = parse_host(parts.hostname)
    if host is None:
        raise InvalidArgument(f"{param} does not name a valid host", param=param)
    if not isinstance(host, str) and not allow_private and not is_public_address(host):
        raise InvalidArgument(
            f"{param} is a loopback, private, link-local or other non-global address, which Berth does not call",
            param=param,
        )
    return value.strip()


def _resource(value: str, param: str) -> str:
    """An absolute URI without a fragment (RFC 8707 section 2)."""
    try:
        parts = urlsplit(value)
    except ValueError as exc:
        raise InvalidArgument(f"{param} is not a valid URI", param=param) from exc
    if not parts.scheme or not parts.netloc or parts.fragment or _HEADER_UNSAFE.search(value) or " " in value:
        raise InvalidArgument(f"{param} must be an absolute URI without a fragment", param=param)
    return value


def _scope(value: str, param: str) -> str:
    if not _SCOPE.fullmatch(value):
        raise InvalidArgument(f"{param} must be space-separated OAuth scope tokens", param=param)
    return value


def _refresh_secret(value: str | None, field: str) -> str:
    param = _SECRET_PARAMS[field]
    if not value:
        raise InvalidArgument(f"{param} is required and must not be empty", param=param)
    if _HEADER_UNSAFE.search(value):
        raise InvalidArgument(f"{param} must not contain carriage returns, newlines or NUL bytes", param=param)
    return value


def _client_secret(method: str, value: str | None) -> str | None:
    """The client secret a token endpoint auth method needs: required for
    the client_secret methods, refused for ``none``."""
    if method == "none":
        if value is not None:
            raise InvalidArgument(
                "token_endpoint_auth type none sends no client secret; omit client_secret",
                param=_SECRET_PARAMS["client_secret"],
            )
        return None
    return _refresh_secret(value, "client_secret")


def _expiry_time(value: str) -> float:
    moment = datetime.fromisoformat(value)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def _refresh_due(auth: vault_pb2.CredentialAuth, now: float) -> bool:
    """Whether an mcp_oauth credential refreshes before use: it has refresh
    configured and an expiry that has passed or is within the margin. An
    unknown expiry is taken as valid."""
    if not auth.HasField("refresh") or not auth.HasField("expires_at"):
        return False
    return _expiry_time(auth.expires_at) <= now + _REFRESH_MARGIN_S


def _statuses(page: VaultListPage) -> list[str]:
    for status in page.statuses:
        if status not in _STATUSES:
            raise InvalidArgument("status must be active or archived", param="status")
    return list(page.statuses)


def _check_page(page: VaultListPage) -> tuple[int, bool]:
    return paging.page_size(page.limit), paging.page_order(page.order) == "desc"


def _matches(metadata_json: str, wanted: Mapping[str, str] | None) -> bool:
    if not wanted:
        return True
    metadata = json.loads(metadata_json)
    return all(metadata.get(k) == v for k, v in wanted.items())


_Row = TypeVar("_Row", VaultRow, VaultCredentialRow)


def _settled(task: asyncio.Task[str]) -> None:
    """Marks a shielded refresh's outcome as seen (its caller may be gone)."""
    if not task.cancelled():
        task.exception()


async def _filtered_page(
    page: VaultListPage, fetch: Callable[[str, bool, list[str]], Awaitable[Sequence[_Row]]]
) -> tuple[list[_Row], bool]:
    """One page of ``fetch`` (rows after a cursor, in order, by status)
    whose metadata matches the page's filter, read in batches."""
    limit, descending = _check_page(page)
    statuses = _statuses(page)
    found: list[_Row] = []
    after = page.after
    while len(found) <= limit:
        batch = await fetch(after, descending, statuses)
        found.extend(r for r in batch if _matches(r.metadata_json, page.metadata))
        if len(batch) < _BATCH:
            break
        after = batch[-1].id
    return found[:limit], len(found) > limit


def vault_key_ring(settings: Settings) -> KeyRing:
    """The vault keys: ``vault_keys``, else ``vault_keys_file``, else
    ``vault.keys`` under the data dir, created (0600) on first start."""
    return KeyRing.load(settings.vault_keys.get_secret_value(), settings.vault_keys_file, settings.data_dir / "vault.keys")


class VaultStore:
    def __init__(self, db: Database, cipher: KeyRing, *, oauth: TokenEndpointClient | None = None) -> None:
        """``oauth`` makes refresh grants; without it, a credential whose
        access token needs refreshing cannot be used."""
        self._db = db
        self._cipher = cipher
        self._oauth = oauth
        self._refresh_locks: dict[str, asyncio.Lock] = {}
        self._refresh_holders: dict[str, int] = {}
        self._refreshing: set[asyncio.Task[str]] = set()

    # Vaults -------------------------------------------------------------------

    async def create_vault(self, org_id: str, *, name: str | None, metadata: Mapping[str, str]) -> VaultRow:
        now = time.time()
        row = VaultRow(
            id=new_id("vault"),
            org_id=org_id,
            name=None if name is None else _name(name, "name"),
            metadata_json=json.dumps(dict(metadata)),
            status="active",
            create_time=now,
            update_time=now,
        )
        async with self._db.transaction() as s:
            s.add(row)
        log.info("vault_created", vault_id=row.id)
        return row

    async def get_vault(self, org_id: str, vault_id: str) -> VaultRow:
        async with self._db.transaction(read_only=True) as s:
            return await self._vault(s, org_id, vault_id)

    @staticmethod
    async def _vault(s: AsyncSession, org_id: str, vault_id: str, *, for_update: bool = False) -> VaultRow:
        row = await repo.get_vault(s, org_id, vault_id, for_update=for_update) if has_prefix(vault_id, "vault") else None
        if row is None:
            raise NotFound(f"vault {vault_id} not found")
        return row

    async def update_vault(
        self, org_id: str, vault_id: str, *, name: str | None | _Unset, metadata: Mapping[str, str] | None
    ) -> VaultRow:
        new_name = name if isinstance(name, _Unset) or name is None else _name(name, "name")
        async with self._db.transaction() as s:
            row = await self._vault(s, org_id, vault_id, for_update=True)
            if not isinstance(new_name, _Unset):
                row.name = new_name
            if metadata is not None:
                row.metadata_json = json.dumps(dict(metadata))
            row.update_time = time.time()
        return row

    async def list_vaults(self, org_id: str, page: VaultListPage) -> tuple[list[VaultRow], bool]:
        async with self._db.transaction(read_only=True) as s:
            return await _filtered_page(
                page,
                lambda after, descending, statuses: repo.list_vaults(
                    s, org_id, after=after, descending=descending, statuses=statuses, limit=_BATCH
                ),
            )

    async def delete_vault(self, org_id: str, vault_id: str) -> None:
        if not has_prefix(vault_id, "vault"):
            raise NotFound(f"vault {vault_id} not found")
        async with self._db.transaction() as s:
            if not await repo.delete_vault(s, org_id, vault_id):
                raise NotFound(f"vault {vault_id} not found")
        log.info("vault_deleted", vault_id=vault_id)

    async def check_vaults(self, org_id: str, vault_ids: Sequence[str], *, param: str = "vault_ids") -> None:
        """NotFound (naming ``param``) unless every vault is the org's."""
        if not vault_ids:
            return
        async with self._db.transaction(read_only=True) as s:
            known = await repo.existing_vault_ids(s, org_id, vault_ids)
        for vault_id in vault_ids:
            if vault_id not in known:
                raise NotFound(f"vault {vault_id} not found", param=param)

    # Credentials --------------------------------------------------------------

    async def create_credential(
        self,
        org_id: str,
        vault_id: str,
        *,
        name: str,
        metadata: Mapping[str, str],
        auth: vault_pb2.CredentialAuth,
        secret: SecretInput,
    ) -> VaultCredentialRow:
        public = self._checked_auth(auth)
        if auth.type == "static_bearer":
            stored = SecretInput(value=_header_secret(secret.value, "auth.token"))
        elif auth.type == _ENV_TYPE:
            stored = SecretInput(value=_header_secret(secret.value, "auth.secret_value"))
        else:
            stored = SecretInput(value=_header_secret(secret.value, "auth.access_token"))
            if public.HasField("refresh"):
                stored = replace(
                    stored,
                    refresh_token=_refresh_secret(secret.refresh_token, "refresh_token"),
                    client_secret=_client_secret(public.refresh.token_endpoint_auth_type, secret.client_secret),
                )
            elif secret.refresh_token is not None or secret.client_secret is not None:
                raise InvalidArgument("a refresh token or client secret needs auth.refresh", param="auth.refresh")
        now = time.time()
        row = VaultCredentialRow(
            id=new_id("vcred"),
            org_id=org_id,
            vault_id=vault_id,
            name=_name(name, "name"),
            metadata_json=json.dumps(dict(metadata)),
            auth_type=public.type,
            auth=public.SerializeToString(),
            secret_ciphertext=self._seal(stored),
            key_id=self._cipher.key_id,
            status="active",
            create_time=now,
            update_time=now,
        )
        async with self._db.transaction() as s:
            await self._vault(s, org_id, vault_id, for_update=True)
            s.add(row)
        log.info("vault_credential_created", vault_id=vault_id, credential_id=row.id, auth_type=row.auth_type)
        return row

    def _checked_auth(self, auth: vault_pb2.CredentialAuth) -> vault_pb2.CredentialAuth:
        """The public part of a new credential's auth, validated."""
        if auth.type == _ENV_TYPE:
            return vault_pb2.CredentialAuth(
                type=_ENV_TYPE,
                secret_name=_secret_name(auth.secret_name, "auth.secret_name"),
                networking=_networking(auth.networking, "auth.networking"),
            )
        if auth.type not in _MCP_TYPES:
            raise InvalidArgument("auth.type must be static_bearer or mcp_oauth", param="auth.type")
        if auth.HasField("refresh") and auth.type != "mcp_oauth":
            raise InvalidArgument("only mcp_oauth credentials refresh", param="auth.refresh")
        public = vault_pb2.CredentialAuth(
            type=auth.type, mcp_server_url=_server_url(auth.mcp_server_url, "auth.mcp_server_url")
        )
        if auth.type == "mcp_oauth" and auth.HasField("expires_at"):
            public.expires_at = _expires_at(auth.expires_at, "auth.expires_at")
        if auth.HasField("refresh"):
            public.refresh.CopyFrom(self._checked_refresh(auth.refresh))
        return public

    def _checked_refresh(self, refresh: vault_pb2.OAuthRefresh) -> vault_pb2.OAuthRefresh:
        if not refresh.client_id or _HEADER_UNSAFE.search(refresh.client_id):
            raise InvalidArgument("auth.refresh.client_id must be a non-empty single line", param="auth.refresh.client_id")
        if refresh.token_endpoint_auth_type not in AUTH_METHODS:
            raise InvalidArgument(
                "auth.refresh.token_endpoint_auth.type must be none, client_secret_basic or client_secret_post",
                param="auth.refresh.token_endpoint_auth.type",
            )
        allow_private = self._oauth is not None and self._oauth.allow_private
        checked = vault_pb2.OAuthRefresh(
            client_id=refresh.client_id,
            token_endpoint=_token_endpoint(
                refresh.token_endpoint, "auth.refresh.token_endpoint", allow_private=allow_private
            ),
            token_endpoint_auth_type=refresh.token_endpoint_auth_type,
        )
        if refresh.HasField("resource"):
            checked.resource = _resource(refresh.resource, "auth.refresh.resource")
        if refresh.HasField("scope"):
            checked.scope = _scope(refresh.scope, "auth.refresh.scope")
        return checked

    async def get_credential(self, org_id: str, vault_id: str, credential_id: str) -> VaultCredentialRow:
        async with self._db.transaction(read_only=True) as s:
            return await self._credential(s, org_id, vault_id, credential_id)

    async def _credential(
        self, s: AsyncSession, org_id: str, vault_id: str, credential_id: str, *, for_update: bool = False
    ) -> VaultCredentialRow:
        await self._vault(s, org_id, vault_id)
        row = None
        if has_prefix(credential_id, "vcred"):
            row = await repo.get_credential(s, org_id, vault_id, credential_id, for_update=for_update)
        if row is None:
            raise NotFound(f"credential {credential_id} not found")
        return row

    async def update_credential(
        self,
        org_id: str,
        vault_id: str,
        credential_id: str,
        *,
        metadata: Mapping[str, str] | None,
        rotation: CredentialRotation | None,
    ) -> VaultCredentialRow:
        if rotation is not None and rotation.type not in (*_MCP_TYPES, "environment_variable"):
            raise InvalidArgument("auth.type must be static_bearer, mcp_oauth or environment_variable", param="auth.type")
        async with self._db.transaction() as s:
            row = await self._credential(s, org_id, vault_id, credential_id, for_update=True)
            if rotation is not None:
                self._rotate(row, rotation)
            if metadata is not None:
                row.metadata_json = json.dumps(dict(metadata))
            row.update_time = time.time()
        if rotation is not None:
            log.info("vault_credential_rotated", vault_id=vault_id, credential_id=credential_id)
        return row

    def _rotate(self, row: VaultCredentialRow, rotation: CredentialRotation) -> None:
        if rotation.type != row.auth_type:
            raise InvalidArgument(f"auth.type must be the credential's own type, {row.auth_type}", param="auth.type")
        auth = vault_pb2.CredentialAuth.FromString(row.auth)
        current = self._open(row)
        if row.auth_type == "static_bearer":
            row.secret_ciphertext = self._seal(SecretInput(value=_header_secret(rotation.secret.value, "auth.token")))
        elif row.auth_type == _ENV_TYPE:
            # The running sandboxes get it after the commit (secret_sync.py).
            secret_value = _header_secret(rotation.secret.value, "auth.secret_value")
            row.secret_ciphertext = self._seal(SecretInput(value=secret_value))
        else:
            stored = self._rotated_refresh(auth, current, rotation)
            if rotation.secret.value is not None:
                stored = replace(stored, value=_header_secret(rotation.secret.value, "auth.access_token"))
                # A new access token without an expiry clears the old one (the SDK's rule).
                auth.ClearField("expires_at")
            if isinstance(rotation.expires_at, str):
                auth.expires_at = _expires_at(rotation.expires_at, "auth.expires_at")
            elif rotation.expires_at is None:
                auth.ClearField("expires_at")
            row.auth = auth.SerializeToString()
            row.secret_ciphertext = self._seal(stored)
        row.key_id = self._cipher.key_id

    @staticmethod
    def _rotated_refresh(
        auth: vault_pb2.CredentialAuth, current: SecretInput, rotation: CredentialRotation
    ) -> SecretInput:
        """The stored secrets with ``auth.refresh``'s replacements applied
        (``auth`` gets the new scope). Refresh is configured at creation;
        a rotation only replaces its secrets and scope."""
        secret = rotation.secret
        given = (
            rotation.refresh
            or secret.refresh_token is not None
            or secret.client_secret is not None
            or not isinstance(rotation.scope, _Unset)
            or bool(rotation.token_endpoint_auth_type)
        )
        if not given:
            return current
        if not auth.HasField("refresh"):
            raise InvalidArgument(
                "the credential has no refresh configuration; create a credential with auth.refresh instead",
                param="auth.refresh",
            )
        method = auth.refresh.token_endpoint_auth_type
        if rotation.token_endpoint_auth_type and rotation.token_endpoint_auth_type != method:
            raise InvalidArgument(
                f"auth.refresh.token_endpoint_auth.type must be the credential's own method, {method}",
                param="auth.refresh.token_endpoint_auth.type",
            )
        stored = current
        if secret.refresh_token is not None:
            stored = replace(stored, refresh_token=_refresh_secret(secret.refresh_token, "refresh_token"))
        if secret.client_secret is not None:
            stored = replace(stored, client_secret=_client_secret(method, secret.client_secret))
        if isinstance(rotation.scope, str):
            auth.refresh.scope = _scope(rotation.scope, "auth.refresh.scope")
        elif rotation.scope is None:
            auth.refresh.ClearField("scope")
        return stored

    async def list_credentials(
        self, org_id: str, vault_id: str, page: VaultListPage
    ) -> tuple[list[VaultCredentialRow], bool]:
        async with self._db.transaction(read_only=True) as s:
            await self._vault(s, org_id, vault_id)
            return await _filtered_page(
                page,
                lambda after, descending, statuses: repo.list_credentials(
                    s, org_id, vault_id, after=after, descending=descending, statuses=statuses, limit=_BATCH
                ),
            )

    async def delete_credential(self, org_id: str, vault_id: str, credential_id: str) -> None:
        async with self._db.transaction() as s:
            await self._vault(s, org_id, vault_id, for_update=True)
            if not has_prefix(credential_id, "vcred") or not await repo.delete_credential(
                s, org_id, vault_id, credential_id
            ):
                raise NotFound(f"credential {credential_id} not found")
        log.info("vault_credential_deleted", vault_id=vault_id, credential_id=credential_id)

    # Use ----------------------------------------------------------------------

    async def resolve_mcp(
        self, org_id: str, vault_ids: Sequence[str], *, credential_id: str, server_url: str
    ) -> tuple[str, str]:
        """(Authorization header value, credential ID) for a connection to
        ``server_url`` with the credentials of ``vault_ids``: the named
        credential, or the one whose URL matches; ("", "") when none does.
        A named credential outside those vaults is NotFound, and one bound
        to another URL is refused."""
        if not vault_ids:
            if credential_id:
                raise NotFound(f"credential {credential_id} not found", param="credential_id")
            return "", ""
        async with self._db.transaction(read_only=True) as s:
            rows = [r for r in await repo.credentials_of(s, org_id, vault_ids) if r.auth_type in _MCP_TYPES]
        target = normalize_url(server_url)
        urls = {r.id: normalize_url(vault_pb2.CredentialAuth.FromString(r.auth).mcp_server_url) for r in rows}
        if credential_id:
            named = [r for r in rows if r.id == credential_id]
            if not named:
                raise NotFound(f"credential {credential_id} not found", param="credential_id")
            if urls[credential_id] != target:
                raise InvalidArgument(
                    f"credential {credential_id} is for another MCP server URL", param="credential_id"
                )
            chosen = named[0]
        else:
            matching = [r for r in rows if urls[r.id] == target]
            if not matching:
                return "", ""
            if len(matching) > 1:
                raise InvalidArgument(
                    "more than one attached credential matches the MCP server URL; name one with credential_id",
                    param="credential_id",
                )
            chosen = matching[0]
        value = self._open(chosen).value or ""
        if chosen.auth_type == "mcp_oauth" and _refresh_due(vault_pb2.CredentialAuth.FromString(chosen.auth), time.time()):
            # A caller that gives up (a deadline) must not abandon a grant
            # half done: the endpoint may have spent the refresh token
            # already, so the refresh runs on and stores what it gets.
            task = asyncio.create_task(self._refreshed(chosen), name=f"oauth-refresh-{chosen.id}")
            self._refreshing.add(task)
            task.add_done_callback(_settled)
            task.add_done_callback(self._refreshing.discard)
            value = await asyncio.shield(task)
        return f"Bearer {value}", chosen.id

    # OAuth refresh ------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _refresh_lock(self, credential_id: str) -> AsyncIterator[None]:
        """This process's refreshes of one credential, one at a time."""
        lock = self._refresh_locks.setdefault(credential_id, asyncio.Lock())
        self._refresh_holders[credential_id] = self._refresh_holders.get(credential_id, 0) + 1
        try:
            async with lock:
                yield
        finally:
            self._refresh_holders[credential_id] -= 1
            if not self._refresh_holders[credential_id]:
                del self._refresh_holders[credential_id]
                del self._refresh_locks[credential_id]

    async def _refreshed(self, row: VaultCredentialRow) -> str:
        """The access token of ``row`` after a refresh if one is still due
        once this caller holds the credential: another caller, or replica,
        may have refreshed it meanwhile."""
        async with self._refresh_lock(row.id):
            if self._db.dialect == "postgresql":
                async with self._db.transaction() as s:
                    locked = await repo.get_credential(s, row.org_id, row.vault_id, row.id, for_update=True)
                    if locked is None:
                        raise NotFound(f"credential {row.id} not found", param="credential_id")
                    auth, current = vault_pb2.CredentialAuth.FromString(locked.auth), self._open(locked)
                    if not _refresh_due(auth, time.time()):
                        return current.value or ""
                    grant = await self._grant(locked, auth, current)
                    if grant is None:
                        return current.value or ""
                    self._store_grant(locked, auth, current, grant)
                    return grant.access_token
            # SQLite: one process writes the file, so the lock above is the
            # exclusion, and the write lock is not held across the grant
            # (it would stall every writer of the service meanwhile).
            async with self._db.transaction(read_only=True) as s:
                fresh = await repo.get_credential(s, row.org_id, row.vault_id, row.id)
            if fresh is None:
                raise NotFound(f"credential {row.id} not found", param="credential_id")
            auth, current = vault_pb2.CredentialAuth.FromString(fresh.auth), self._open(fresh)
            if not _refresh_due(auth, time.time()):
                return current.value or ""
            grant = await self._grant(fresh, auth, current)
            if grant is None:
                return current.value or ""
            async with self._db.transaction() as s:
                locked = await repo.get_credential(s, row.org_id, row.vault_id, row.id, for_update=True)
                latest = None if locked is None else self._open(locked)
                # A refresh token replaced through the API meanwhile wins.
                if locked is not None and latest is not None and latest.refresh_token == current.refresh_token:
                    self._store_grant(locked, vault_pb2.CredentialAuth.FromString(locked.auth), latest, grant)
            return grant.access_token

    async def _grant(
        self, row: VaultCredentialRow, auth: vault_pb2.CredentialAuth, current: SecretInput
    ) -> TokenGrant | None:
        """A refresh grant for ``row``; None when it failed but the current
        access token has not expired yet (it is used while it lasts)."""
        refresh = auth.refresh
        try:
            if self._oauth is None:
                raise OAuthRefreshFailed("OAuth refresh is not available in this process")
            return await self._oauth.refresh(
                TokenRequest(
                    token_endpoint=refresh.token_endpoint,
                    client_id=refresh.client_id,
                    auth_method=refresh.token_endpoint_auth_type,
                    refresh_token=current.refresh_token or "",
                    client_secret=current.client_secret,
                    resource=refresh.resource if refresh.HasField("resource") else None,
                    scope=refresh.scope if refresh.HasField("scope") else None,
                )
            )
        except OAuthRefreshFailed as exc:
            expired = _expiry_time(auth.expires_at) <= time.time()
            log.warning(
                "vault_credential_refresh_failed",
                vault_id=row.vault_id,
                credential_id=row.id,
                error=exc.message,
                access_token_expired=expired,
            )
            if not expired:
                return None
            raise OAuthRefreshFailed(
                f"credential {row.id}: its access token expired and refreshing it failed: {exc.message}",
                param="credential_id",
            ) from None

    def _store_grant(
        self, row: VaultCredentialRow, auth: vault_pb2.CredentialAuth, current: SecretInput, grant: TokenGrant
    ) -> None:
        now = time.time()
        if grant.expires_in is None:
            auth.ClearField("expires_at")
        else:
            expiry = datetime.fromtimestamp(now + grant.expires_in, UTC)
            auth.expires_at = expiry.isoformat(timespec="seconds").replace("+00:00", "Z")
        stored = replace(current, value=grant.access_token, refresh_token=grant.refresh_token or current.refresh_token)
        row.auth = auth.SerializeToString()
        row.secret_ciphertext = self._seal(stored)
        row.key_id = self._cipher.key_id
        row.update_time = now
        log.info(
            "vault_credential_refreshed",
            vault_id=row.vault_id,
            credential_id=row.id,
            refresh_token_rotated=grant.refresh_token is not None,
            expires_in=grant.expires_in,
        )
    async def environment_variable_credentials(
        self, org_id: str, vault_ids: Sequence[str]
    ) -> list[tuple[str, vault_pb2.CredentialAuth]]:
        """(credential ID, public auth) of every environment_variable
        credential of ``vault_ids``, oldest first; no secret is opened."""
        if not vault_ids:
            return []
        async with self._db.transaction(read_only=True) as s:
            rows = await repo.credentials_of(s, org_id, vault_ids)
        return [(r.id, vault_pb2.CredentialAuth.FromString(r.auth)) for r in rows if r.auth_type == _ENV_TYPE]

    async def environment_secrets(
        self, org_id: str, vault_ids: Sequence[str], *, distinct_names: bool = True
    ) -> list[EnvironmentSecret]:
        """The environment_variable credentials of an environment's own
        ``vault_ids``, with their secrets, for creating its sandbox. Two
        credentials for one variable are refused: which one a sandbox got
        would depend on the order of its vaults. Updating a running sandbox
        (``distinct_names=False``) matches by credential ID instead, so
        there they do not matter."""
        if not vault_ids:
            return []
        async with self._db.transaction(read_only=True) as s:
            rows = [r for r in await repo.credentials_of(s, org_id, vault_ids) if r.auth_type == _ENV_TYPE]
        secrets: list[EnvironmentSecret] = []
        seen: dict[str, str] = {}
        for row in rows:
            auth = vault_pb2.CredentialAuth.FromString(row.auth)
            if distinct_names and auth.secret_name in seen:
                raise InvalidArgument(
                    f"credentials {seen[auth.secret_name]} and {row.id} both set {auth.secret_name}", param="vault_ids"
                )
            seen[auth.secret_name] = row.id
            secrets.append(
                EnvironmentSecret(
                    credential_id=row.id,
                    secret_name=auth.secret_name,
                    value=self._open(row).value or "",
                    any_allowed_host=auth.networking.type == "unrestricted",
                    allowed_hosts=tuple(auth.networking.allowed_hosts),
                )
            )
        return secrets

    # Encryption ---------------------------------------------------------------

    def _seal(self, secret: SecretInput) -> bytes:
        payload = {k: v for k, v in vars(secret).items() if v is not None}
        return self._cipher.encrypt(json.dumps(payload).encode())

    def _open(self, row: VaultCredentialRow) -> SecretInput:
        payload = json.loads(self._cipher.decrypt(row.secret_ciphertext))
        return SecretInput(**payload)

    async def rotate(self) -> int:
        """Re-encrypts every credential not sealed with the first key; returns
        how many. Safe on several replicas at once (rows are locked)."""
        done = 0
        while True:
            async with self._db.transaction() as s:
                rows = await repo.stale_credentials(s, self._cipher.key_id, limit=_BATCH)
                for row in rows:
                    row.secret_ciphertext = self._cipher.rotate(row.secret_ciphertext)
                    row.key_id = self._cipher.key_id
            done += len(rows)
            if len(rows) < _BATCH:
                break
        if done:
            log.info("vault_keys_rotated", credentials=done, key_id=self._cipher.key_id)
        return done

