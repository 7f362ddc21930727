"""OAuth refresh of ``mcp_oauth`` vault credentials in the Environment
service's vault store, against a real https token endpoint on 127.0.0.1:
one grant for concurrent connections (in one process, and across two
replicas on PostgreSQL), the rotated refresh token stored and used next,
each client authentication method, failures that name their cause and
quote no secret, and the SSRF rule on the token endpoint."""

from __future__ import annotations

import asyncio
import datetime
import io
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from cryptography.fernet import Fernet
from db_support import migrations_of, service_database
from oauth_support import Grant, LocalCA, TokenServer, make_test_ca, token_server

from berth.environment.v1 import vault_pb2
from services.core.db import Database, open_database
from services.core.errors import InvalidArgument, OAuthRefreshFailed
from services.core.key_ring import KeyRing
from services.core.logging import capture_json_logs
from services.core.settings import Settings, normalize_database_url
from services.environment.oauth_refresh import TokenEndpointClient
from services.environment.vaults import UNSET, CredentialRotation, SecretInput, VaultListPage, VaultStore

MIGRATIONS = migrations_of("environment")
URL = "https://mcp.example.test/mcp"
EXPIRED = "oauth-expired-access-5d1e"
REFRESH_1, REFRESH_2, REFRESH_3 = "oauth-refresh-one-77c1", "oauth-refresh-two-a0b2", "oauth-refresh-three-19fe"
ACCESS_1, ACCESS_2 = "oauth-access-one-4be0", "oauth-access-two-c93d"
CLIENT_SECRET = "oauth-client-secret-e6f3"
SECRETS = (EXPIRED, REFRESH_1, REFRESH_2, REFRESH_3, ACCESS_1, ACCESS_2, CLIENT_SECRET)
PAST = "2020-01-01T00:00:00Z"


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> LocalCA:
    return make_test_ca(tmp_path_factory.mktemp("oauth-ca"))


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[Database]:
    """On SQLite and on PostgreSQL: their refreshes lock differently."""
    async with service_database(database_url, "environment") as database:
        yield database


@pytest.fixture
async def sqlite_db(sqlite_url: str) -> AsyncIterator[Database]:
    async with service_database(sqlite_url, "environment") as database:
        yield database


def settings(ca: LocalCA, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "oauth_allow_private_endpoints": True,
        "outbound_ca_bundle": str(ca.bundle),
        "oauth_refresh_timeout_s": 5.0,
        **overrides,
    }
    return Settings(**values)


@pytest.fixture
async def oauth(ca: LocalCA) -> AsyncIterator[TokenEndpointClient]:
    client = TokenEndpointClient(settings(ca))
    try:
        yield client
    finally:
        await client.close()


KEYS = [Fernet.generate_key()]


def store(db: Database, oauth: TokenEndpointClient | None) -> VaultStore:
    return VaultStore(db, KeyRing(KEYS), oauth=oauth)


def oauth_auth(server: TokenServer, *, expires_at: str | None = PAST, **refresh: str) -> vault_pb2.CredentialAuth:
    auth = vault_pb2.CredentialAuth(type="mcp_oauth", mcp_server_url=URL)
    if expires_at is not None:
        auth.expires_at = expires_at
    auth.refresh.CopyFrom(
        vault_pb2.OAuthRefresh(
            client_id=server.client_id,
            token_endpoint=server.url,
            token_endpoint_auth_type=server.auth_method,
            **refresh,
        )
    )
    return auth


async def resolved(vaults: VaultStore, vault_id: str) -> tuple[str, str]:
    """What a connection to ``URL`` with the vault gets, matched by URL."""
    return await vaults.resolve_mcp("org_a", [vault_id], credential_id="", server_url=URL)


async def oauth_credential(
    vaults: VaultStore, server: TokenServer, *, expires_at: str | None = PAST, **refresh: str
) -> tuple[str, str]:
    vault = await vaults.create_vault("org_a", name=None, metadata={})
    row = await vaults.create_credential(
        "org_a",
        vault.id,
        name="remote",
        metadata={},
        auth=oauth_auth(server, expires_at=expires_at, **refresh),
        secret=SecretInput(value=EXPIRED, refresh_token=REFRESH_1, client_secret=server.client_secret),
    )
    return vault.id, row.id


@pytest.fixture
def basic_server(ca: LocalCA) -> Iterator[TokenServer]:
    with token_server(
        ca,
        client_id="berth-client",
        client_secret=CLIENT_SECRET,
        auth_method="client_secret_basic",
        refresh_token=REFRESH_1,
        grants=[Grant(ACCESS_1, REFRESH_2), Grant(ACCESS_2, REFRESH_3)],
    ) as server:
        yield server


async def test_concurrent_connections_spend_the_refresh_token_once_and_the_rotated_one_is_used_next(
    db: Database, oauth: TokenEndpointClient, basic_server: TokenServer
) -> None:
    vaults = store(db, oauth)
    logs = io.StringIO()
    # Unserialized callers would both reach the endpoint within this hold.
    basic_server.hold_for_second_s = 0.5
    with capture_json_logs(logs, level="DEBUG"):
        vault_id, credential_id = await oauth_credential(vaults, basic_server)
        first, second = await asyncio.gather(
            vaults.resolve_mcp("org_a", [vault_id], credential_id="", server_url=URL),
            vaults.resolve_mcp("org_a", [vault_id], credential_id=credential_id, server_url=URL),
        )
        assert first == second == (f"Bearer {ACCESS_1}", credential_id)
        assert basic_server.presented == [REFRESH_1] and basic_server.refused == []
        basic_server.hold_for_second_s = 0

        row = await vaults.get_credential("org_a", vault_id, credential_id)
        auth = vault_pb2.CredentialAuth.FromString(row.auth)
        assert auth.expires_at > "2026" and auth.refresh.client_id == "berth-client"
        # Still fresh: no grant.
        assert await resolved(vaults, vault_id) == (f"Bearer {ACCESS_1}", credential_id)
        assert basic_server.calls == 1

        # Expired again: the refresh token the first grant rotated in is spent.
        await vaults.update_credential(
            "org_a", vault_id, credential_id, metadata=None,
            rotation=CredentialRotation(type="mcp_oauth", secret=SecretInput(), expires_at=PAST),
        )
        assert await resolved(vaults, vault_id) == (f"Bearer {ACCESS_2}", credential_id)
        assert basic_server.presented == [REFRESH_1, REFRESH_2]
    row = await vaults.get_credential("org_a", vault_id, credential_id)
    for secret in SECRETS:
        assert secret.encode() not in row.secret_ciphertext and secret.encode() not in row.auth
        assert secret not in logs.getvalue()
    assert "vault_credential_refreshed" in logs.getvalue()


@pytest.mark.postgres
async def test_two_replicas_on_postgresql_spend_a_single_use_refresh_token_once(
    postgres_database: str, oauth: TokenEndpointClient, basic_server: TokenServer
) -> None:
    import asyncpg

    conn = await asyncpg.connect(postgres_database, timeout=3)
    try:
        await conn.execute("DROP SCHEMA IF EXISTS public CASCADE; CREATE SCHEMA public;")
    finally:
        await conn.close()
    url = normalize_database_url(postgres_database)
    one = await open_database(url, "environment", MIGRATIONS)
    two = await open_database(url, "environment", MIGRATIONS)
    try:
        replica_one, replica_two = store(one, oauth), store(two, oauth)
        basic_server.hold_for_second_s = 0.5
        vault_id, credential_id = await oauth_credential(replica_one, basic_server)
        results = await asyncio.gather(
            replica_one.resolve_mcp("org_a", [vault_id], credential_id="", server_url=URL),
            replica_two.resolve_mcp("org_a", [vault_id], credential_id="", server_url=URL),
        )
        assert list(results) == [(f"Bearer {ACCESS_1}", credential_id)] * 2
        assert basic_server.presented == [REFRESH_1] and basic_server.refused == []
    finally:
        await one.dispose()
        await two.dispose()


@pytest.mark.parametrize("method", ["none", "client_secret_post", "client_secret_basic"])
async def test_each_client_authentication_method_reaches_the_token_endpoint_with_resource_and_scope(
    sqlite_db: Database, oauth: TokenEndpointClient, ca: LocalCA, method: str
) -> None:
    secret = None if method == "none" else CLIENT_SECRET
    resource, scope = "https://mcp.example.test/", "tools:read tools:call"
    with token_server(
        ca, client_id="c+1 id", client_secret=secret, auth_method=method, refresh_token=REFRESH_1,
        grants=[Grant(ACCESS_1, None, expires_in=None)], expect_resource=resource, expect_scope=scope,
    ) as server:
        vaults = store(sqlite_db, oauth)
        vault_id, credential_id = await oauth_credential(vaults, server, resource=resource, scope=scope)
        assert await resolved(vaults, vault_id) == (f"Bearer {ACCESS_1}", credential_id)
        assert server.presented == [REFRESH_1] and server.refused == []
    row = await vaults.get_credential("org_a", vault_id, credential_id)
    # No expires_in: the expiry is unknown from now on, and the refresh token was kept.
    assert not vault_pb2.CredentialAuth.FromString(row.auth).HasField("expires_at")
    assert await resolved(vaults, vault_id) == (f"Bearer {ACCESS_1}", credential_id)


@pytest.mark.parametrize("mode", ["invalid_grant", "http_500", "not_json", "hang"])
async def test_a_failing_refresh_fails_the_connection_naming_the_cause_and_no_secret(
    sqlite_db: Database, ca: LocalCA, mode: str
) -> None:
    oauth = TokenEndpointClient(settings(ca, oauth_refresh_timeout_s=0.5))
    logs = io.StringIO()
    try:
        with token_server(
            ca, client_id="c", client_secret=CLIENT_SECRET, auth_method="client_secret_post",
            refresh_token=REFRESH_1, grants=[Grant(ACCESS_1, REFRESH_2)], mode=mode,
        ) as server, capture_json_logs(logs, level="DEBUG"):
            vaults = store(sqlite_db, oauth)
            vault_id, credential_id = await oauth_credential(vaults, server)
            with pytest.raises(OAuthRefreshFailed) as failed:
                await vaults.resolve_mcp("org_a", [vault_id], credential_id="", server_url=URL)
    finally:
        await oauth.close()
    assert failed.value.reason == "OAUTH_REFRESH_FAILED" and credential_id in failed.value.message
    causes = {"invalid_grant": "(invalid_grant)", "http_500": "HTTP 500", "not_json": "without JSON", "hang": "within"}
    assert causes[mode] in failed.value.message
    assert "vault_credential_refresh_failed" in logs.getvalue() and credential_id in logs.getvalue()
    for secret in SECRETS:
        assert secret not in failed.value.message and secret not in logs.getvalue()
    # Nothing was stored: the expired token stays, still due.
    row = await vaults.get_credential("org_a", vault_id, credential_id)
    assert vault_pb2.CredentialAuth.FromString(row.auth).expires_at == PAST


async def test_a_failing_refresh_of_a_token_not_yet_expired_uses_the_token_while_it_lasts(
    sqlite_db: Database, oauth: TokenEndpointClient, ca: LocalCA
) -> None:
    expires_at = (datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=30)).isoformat()
    with token_server(
        ca, client_id="c", client_secret=None, auth_method="none", refresh_token=REFRESH_1,
        grants=[], mode="invalid_grant",
    ) as server:
        vaults = store(sqlite_db, oauth)
        vault_id, credential_id = await oauth_credential(vaults, server, expires_at=expires_at)
        assert await resolved(vaults, vault_id) == (f"Bearer {EXPIRED}", credential_id)
        assert server.refused == [REFRESH_1]


async def test_a_token_endpoint_on_a_private_address_is_refused_without_the_setting(
    sqlite_db: Database, ca: LocalCA, basic_server: TokenServer
) -> None:
    strict = TokenEndpointClient(settings(ca, oauth_allow_private_endpoints=False))
    try:
        vaults = store(sqlite_db, strict)
        private = ("https://10.0.0.7/token", "https://[::1]/token", "https://169.254.169.254/latest")
        for endpoint in (basic_server.url, *private):
            auth = oauth_auth(basic_server)
            auth.refresh.token_endpoint = endpoint
            vault = await vaults.create_vault("org_a", name=None, metadata={})
            with pytest.raises(InvalidArgument) as refused:
                await vaults.create_credential(
                    "org_a", vault.id, name="x", metadata={}, auth=auth,
                    secret=SecretInput(value=EXPIRED, refresh_token=REFRESH_1, client_secret=CLIENT_SECRET),
                )
            assert refused.value.param == "auth.refresh.token_endpoint"
            assert await vaults.list_credentials("org_a", vault.id, VaultListPage()) == ([], False)
        # A name is checked where it resolves, at refresh: localhost is loopback.
        auth = oauth_auth(basic_server)
        auth.refresh.token_endpoint = basic_server.url.replace("127.0.0.1", "localhost")
        vault = await vaults.create_vault("org_a", name=None, metadata={})
        row = await vaults.create_credential(
            "org_a", vault.id, name="x", metadata={}, auth=auth,
            secret=SecretInput(value=EXPIRED, refresh_token=REFRESH_1, client_secret=CLIENT_SECRET),
        )
        with pytest.raises(OAuthRefreshFailed) as failed:
            await vaults.resolve_mcp("org_a", [vault.id], credential_id=row.id, server_url=URL)
        assert "non-global" in failed.value.message
        assert basic_server.calls == 0 and basic_server.refused == []
    finally:
        await strict.close()


def _create_cases() -> list[tuple[str, dict[str, Any], SecretInput, str]]:
    good = {
        "client_id": "c",
        "token_endpoint": "https://auth.example.test/token",
        "token_endpoint_auth_type": "client_secret_basic",
    }
    full = SecretInput(value="a", refresh_token="r", client_secret="s")
    secret_param = "auth.refresh.token_endpoint_auth.client_secret"
    return [
        ("basic without a client secret", good, SecretInput(value="a", refresh_token="r"), secret_param),
        ("none with a client secret", {**good, "token_endpoint_auth_type": "none"}, full, secret_param),
        ("no refresh token", good, SecretInput(value="a", client_secret="s"), "auth.refresh.refresh_token"),
        ("an http token endpoint", {**good, "token_endpoint": "http://127.0.0.1/token"}, full, "auth.refresh.token_endpoint"),
        ("an unknown method", {**good, "token_endpoint_auth_type": "private_key_jwt"}, full, "auth.refresh.token_endpoint_auth.type"),
        ("a scope with a quote", {**good, "scope": 'a "b'}, full, "auth.refresh.scope"),
        ("a relative resource", {**good, "resource": "/mcp"}, full, "auth.refresh.resource"),
        ("no client id", {**good, "client_id": ""}, full, "auth.refresh.client_id"),
    ]


async def test_invalid_refresh_configuration_is_refused_by_name_and_nothing_is_stored(
    sqlite_db: Database, oauth: TokenEndpointClient
) -> None:
    vaults = store(sqlite_db, oauth)
    for case, refresh, secret, param in _create_cases():
        vault = await vaults.create_vault("org_a", name=None, metadata={})
        auth = vault_pb2.CredentialAuth(type="mcp_oauth", mcp_server_url=URL, refresh=vault_pb2.OAuthRefresh(**refresh))
        with pytest.raises(InvalidArgument) as refused:
            await vaults.create_credential("org_a", vault.id, name="x", metadata={}, auth=auth, secret=secret)
        assert refused.value.param == param, case
        assert await vaults.list_credentials("org_a", vault.id, VaultListPage()) == ([], False), case


async def test_a_rotation_replaces_refresh_secrets_and_scope_but_not_the_method(
    sqlite_db: Database, oauth: TokenEndpointClient, basic_server: TokenServer
) -> None:
    vaults = store(sqlite_db, oauth)
    vault_id, credential_id = await oauth_credential(vaults, basic_server, scope="a")
    with pytest.raises(InvalidArgument) as wrong:
        await vaults.update_credential(
            "org_a", vault_id, credential_id, metadata=None,
            rotation=CredentialRotation(
                type="mcp_oauth", secret=SecretInput(client_secret="x"), refresh=True,
                token_endpoint_auth_type="client_secret_post",
            ),
        )
    assert wrong.value.param == "auth.refresh.token_endpoint_auth.type"
    basic_server.refresh_token = "oauth-refresh-replaced-3d"
    basic_server.client_secret = "oauth-client-secret-new-9a"
    await vaults.update_credential(
        "org_a", vault_id, credential_id, metadata=None,
        rotation=CredentialRotation(
            type="mcp_oauth",
            secret=SecretInput(refresh_token="oauth-refresh-replaced-3d", client_secret="oauth-client-secret-new-9a"),
            refresh=True, scope=None, token_endpoint_auth_type="client_secret_basic",
        ),
    )
    row = await vaults.get_credential("org_a", vault_id, credential_id)
    assert not vault_pb2.CredentialAuth.FromString(row.auth).refresh.HasField("scope")
    assert await resolved(vaults, vault_id) == (f"Bearer {ACCESS_1}", credential_id)
    assert basic_server.presented == ["oauth-refresh-replaced-3d"]

    # A rotation that names refresh on a credential without it is refused.
    vault = await vaults.create_vault("org_a", name=None, metadata={})
    plain = await vaults.create_credential(
        "org_a", vault.id, name="p", metadata={}, auth=vault_pb2.CredentialAuth(type="mcp_oauth", mcp_server_url=URL),
        secret=SecretInput(value="a"),
    )
    with pytest.raises(InvalidArgument) as none:
        await vaults.update_credential(
            "org_a", vault.id, plain.id, metadata=None,
            rotation=CredentialRotation(
                type="mcp_oauth", secret=SecretInput(refresh_token="r"), refresh=True, scope=UNSET
            ),
        )
    assert none.value.param == "auth.refresh"
