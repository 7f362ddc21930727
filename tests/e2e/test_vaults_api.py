"""Vaults and credentials through the official SDK with strict response
validation: every method of ``vaults`` and ``vaults.credentials``; secrets
go in and never come out; unsupported kinds are refused by name; another
organization's IDs are 404 and scopes split reads from writes. One stack
serves the module (no sandbox is ever created)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio
from e2e_stack import Stack, start_stack
from e2e_support import api_error, assert_error

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOKEN = "vault-test-bearer-7c1f0e9a"
ROTATED = "vault-test-rotated-52b8d3"
ACCESS = "vault-test-oauth-access-91aa"
MCP_URL = "https://mcp.example.test/mcp"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    s, stop = await start_stack(tmp_path_factory.mktemp("vaults") / "berth")
    try:
        yield s
    finally:
        await stop()  # type: ignore[misc]


def strict(stack: Stack, key: str | None = None) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=stack.base_url, api_key=key or stack.key, max_retries=0, timeout=30, _strict_response_validation=True
    )


async def test_every_vault_method_round_trips_through_the_sdk(stack: Stack) -> None:
    vaults = strict(stack).beta.agents.vaults
    first = await vaults.create(name="  team vault  ", metadata={"team": "a"})
    assert (first.object, first.name, first.metadata) == ("vault", "team vault", {"team": "a"})
    unnamed = await vaults.create()
    assert (unnamed.name, unnamed.metadata) == (None, {})
    assert (await vaults.retrieve(first.id)) == first

    renamed = await vaults.update(first.id, name="renamed")
    assert (renamed.name, renamed.metadata) == ("renamed", {"team": "a"})
    cleared = await vaults.update(first.id, name=None, metadata={"team": "b"})
    assert (cleared.name, cleared.metadata) == (None, {"team": "b"})

    listed = [v.id async for v in vaults.list()]
    assert listed[:2] == [unnamed.id, first.id]
    assert [v.id async for v in vaults.list(order="asc", limit=1)][:2] == [first.id, unnamed.id]
    assert [v.id async for v in vaults.list(metadata={"team": "b"})] == [first.id]
    assert [v.id async for v in vaults.list(status="archived")] == []
    assert len([v async for v in vaults.list(status=["active", "archived"])]) == len(listed)

    deleted = await vaults.delete(unnamed.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (unnamed.id, "vault.deleted", True)
    assert (await api_error(vaults.retrieve(unnamed.id))).status_code == 404


async def test_every_credential_method_round_trips_and_no_response_carries_a_secret(stack: Stack) -> None:
    client = strict(stack)
    vault = await client.beta.agents.vaults.create(name="creds")
    credentials = client.beta.agents.vaults.credentials
    bearer = await credentials.create(
        vault.id,
        name="bearer",
        metadata={"kind": "bearer"},
        auth={"type": "static_bearer", "token": TOKEN, "mcp_server_url": MCP_URL},
        extra_headers={"Idempotency-Key": "bearer-1"},
    )
    replayed = await credentials.create(
        vault.id,
        name="bearer",
        metadata={"kind": "bearer"},
        auth={"type": "static_bearer", "token": TOKEN, "mcp_server_url": MCP_URL},
        extra_headers={"Idempotency-Key": "bearer-1"},
    )
    assert replayed == bearer
    assert (bearer.object, bearer.vault_id, bearer.name, bearer.metadata) == (
        "vault.credential",
        vault.id,
        "bearer",
        {"kind": "bearer"},
    )
    assert bearer.auth.type == "static_bearer" and bearer.auth.mcp_server_url == MCP_URL
    oauth = await credentials.create(
        vault.id,
        name="oauth",
        auth={"type": "mcp_oauth", "access_token": ACCESS, "mcp_server_url": MCP_URL, "expires_at": "2030-01-01T00:00:00Z"},
    )
    assert oauth.auth.type == "mcp_oauth" and oauth.auth.expires_at == "2030-01-01T00:00:00Z"
    assert (await credentials.retrieve(bearer.id, vault_id=vault.id)) == bearer
    assert [c.id async for c in credentials.list(vault.id)] == [oauth.id, bearer.id]
    assert [c.id async for c in credentials.list(vault.id, metadata={"kind": "bearer"})] == [bearer.id]

    relabelled = await credentials.update(bearer.id, vault_id=vault.id, metadata={"kind": "rotated"})
    assert relabelled.metadata == {"kind": "rotated"}
    rotated = await credentials.update(bearer.id, vault_id=vault.id, auth={"type": "static_bearer", "token": ROTATED})
    assert rotated.auth == bearer.auth and rotated.metadata == {"kind": "rotated"}
    # A new access token without an expiry clears the old expiry.
    refreshed = await credentials.update(oauth.id, vault_id=vault.id, auth={"type": "mcp_oauth", "access_token": "x2"})
    assert refreshed.auth.type == "mcp_oauth" and refreshed.auth.expires_at is None

    async with stack.http() as http:
        for path in (f"/vaults/{vault.id}/credentials", f"/vaults/{vault.id}/credentials/{bearer.id}"):
            body = (await http.get(path)).text
            assert TOKEN not in body and ROTATED not in body and ACCESS not in body
    # Encrypted at rest: no database (nor the idempotency record) holds a secret.
    for database in stack.data_dir.rglob("*.db*"):
        stored = database.read_bytes()
        assert TOKEN.encode() not in stored and ROTATED.encode() not in stored and ACCESS.encode() not in stored, database

    gone = await credentials.delete(bearer.id, vault_id=vault.id)
    assert (gone.id, gone.object, gone.deleted) == (bearer.id, "vault.credential.deleted", True)
    assert (await api_error(credentials.retrieve(bearer.id, vault_id=vault.id))).status_code == 404
    await client.beta.agents.vaults.delete(vault.id)
    assert (await api_error(credentials.retrieve(oauth.id, vault_id=vault.id))).status_code == 404


LIMITED: dict[str, Any] = {"type": "limited", "allowed_hosts": ["api.example.com"]}
_ENV_REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("a secret_name that is no variable name", {"secret_name": "1-API"}, "auth.secret_name"),
    ("a secret_name Berth sets itself", {"secret_name": "HTTPS_PROXY"}, "auth.secret_name"),
    ("a secret_name of Berth's own prefix", {"secret_name": "BERTH_TOKEN"}, "auth.secret_name"),
    ("an empty secret_value", {"secret_value": ""}, "auth.secret_value"),
    ("a secret_value that would split a header", {"secret_value": "s\r\nX-Evil: 1"}, "auth.secret_value"),
    ("limited networking without hosts", {"networking": {"type": "limited", "allowed_hosts": []}}, "auth.networking.allowed_hosts"),
    ("an allowed host with a port", {"networking": {"type": "limited", "allowed_hosts": ["api.example.com:443"]}}, "auth.networking.allowed_hosts[0]"),
    ("an allowed host with a scheme", {"networking": {"type": "limited", "allowed_hosts": ["https://api.example.com"]}}, "auth.networking.allowed_hosts[0]"),
    ("a wildcard allowed host", {"networking": {"type": "limited", "allowed_hosts": ["ok.example.com", "*.example.com"]}}, "auth.networking.allowed_hosts[1]"),
    ("an IPv6 allowed host", {"networking": {"type": "limited", "allowed_hosts": ["::1"]}}, "auth.networking.allowed_hosts[0]"),
    ("17 allowed hosts", {"networking": {"type": "limited", "allowed_hosts": [f"h{i}.example.com" for i in range(17)]}}, "auth.networking.allowed_hosts"),
    ("allowed hosts that differ only in case", {"networking": {"type": "limited", "allowed_hosts": ["a.example.com", "A.example.com"]}}, "auth.networking.allowed_hosts"),
]
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    *[
        (case, {"type": "environment_variable", "secret_name": "API_KEY", "secret_value": "s", "networking": LIMITED, **change}, param)
        for case, change, param in _ENV_REFUSED
    ],
    ("plain http off loopback", {"type": "static_bearer", "token": "t", "mcp_server_url": "http://mcp.example.test/"}, "auth.mcp_server_url"),
    ("a token that would split a header", {"type": "static_bearer", "token": "t\r\nX-Evil: 1", "mcp_server_url": MCP_URL}, "auth.token"),
    ("an empty token", {"type": "static_bearer", "token": "", "mcp_server_url": MCP_URL}, "auth.token"),
    ("an unknown auth field", {"type": "static_bearer", "token": "t", "mcp_server_url": MCP_URL, "scope": "x"}, "auth.scope"),
    (
        "an OAuth token endpoint on a loopback address (BERTH_OAUTH_ALLOW_PRIVATE_ENDPOINTS is off)",
        {
            "type": "mcp_oauth",
            "access_token": "a",
            "mcp_server_url": MCP_URL,
            "refresh": {
                "client_id": "c",
                "refresh_token": "r",
                "token_endpoint": "https://127.0.0.1:8443/token",
                "token_endpoint_auth": {"type": "none"},
            },
        },
        "auth.refresh.token_endpoint",
    ),
]


@pytest.mark.parametrize(("case", "auth", "param"), REFUSED, ids=[c for c, _, _ in REFUSED])
async def test_a_credential_berth_cannot_honour_is_refused_by_name_and_nothing_is_stored(
    stack: Stack, case: str, auth: dict[str, Any], param: str
) -> None:
    client = strict(stack)
    vault = await client.beta.agents.vaults.create()
    refused = await api_error(client.beta.agents.vaults.credentials.create(vault.id, name="x", auth=auth))  # type: ignore[arg-type]
    assert (refused.status_code, refused.code) == (400, "validation_error")
    assert refused.body["param"] == param  # type: ignore[index]
    assert [c async for c in client.beta.agents.vaults.credentials.list(vault.id)] == []


async def test_a_rotation_of_another_type_or_a_blank_name_is_refused(stack: Stack) -> None:
    client = strict(stack)
    vault = await client.beta.agents.vaults.create()
    assert (await api_error(client.beta.agents.vaults.create(name="   "))).status_code == 400
    credential = await client.beta.agents.vaults.credentials.create(
        vault.id, name="b", auth={"type": "static_bearer", "token": "t", "mcp_server_url": MCP_URL}
    )
    wrong = await api_error(
        client.beta.agents.vaults.credentials.update(
            credential.id, vault_id=vault.id, auth={"type": "mcp_oauth", "access_token": "a"}
        )
    )
    assert (wrong.status_code, wrong.body["param"]) == (400, "auth.type")  # type: ignore[index]


async def test_unknown_or_foreign_vault_ids_on_environments_and_sessions_are_404(stack: Stack) -> None:
    other = strict(stack, await stack.new_key("org-b"))
    foreign = await other.beta.agents.vaults.create()
    client = strict(stack)
    mine = await client.beta.agents.vaults.create()
    async with stack.http() as http:
        for vault_id in (foreign.id, "vault_doesnotexist"):
            environment = await http.post(
                "/agents/environments", json={"environment": {"type": "openai_hosted"}, "vault_ids": [mine.id, vault_id]}
            )
            assert_error(environment, 404, "not_found")
            for env in ({"type": "none"}, {"type": "openai_hosted"}):
                session = await http.post(
                    "/agents/sessions",
                    json={"agent": {"model": "scripted"}, "environment": env, "vault_ids": [vault_id], "input": "hi"},
                )
                assert_error(session, 404, "not_found")
        assert (await http.get("/agents/environments")).json()["data"] == []
        assert (await http.get("/agents/sessions")).json()["data"] == []
        accepted = await http.post(
            "/agents/environments", json={"environment": {"type": "openai_hosted"}, "vault_ids": [mine.id]}
        )
        assert accepted.status_code == 201 and accepted.json()["vault_ids"] == [mine.id]


async def test_another_organizations_vault_and_credential_ids_are_404_on_every_route_and_untouched(stack: Stack) -> None:
    client = strict(stack)
    vault = await client.beta.agents.vaults.create(name="mine")
    credential = await client.beta.agents.vaults.credentials.create(
        vault.id, name="mine", auth={"type": "static_bearer", "token": "t", "mcp_server_url": MCP_URL}
    )
    v, c = vault.id, credential.id
    routes: list[tuple[str, str, dict[str, Any] | None]] = [
        ("GET", f"/vaults/{v}", None),
        ("POST", f"/vaults/{v}", {"name": "stolen"}),
        ("DELETE", f"/vaults/{v}", None),
        ("POST", f"/vaults/{v}/credentials", {"name": "x", "auth": {"type": "static_bearer", "token": "t", "mcp_server_url": MCP_URL}}),
        ("GET", f"/vaults/{v}/credentials", None),
        ("GET", f"/vaults/{v}/credentials/{c}", None),
        ("POST", f"/vaults/{v}/credentials/{c}", {"metadata": {"stolen": "yes"}}),
        ("DELETE", f"/vaults/{v}/credentials/{c}", None),
    ]
    async with stack.http(await stack.new_key("org-intruder")) as http:
        for method, path, body in routes:
            assert_error(await http.request(method, path, json=body), 404, "not_found")
        assert (await http.get("/vaults")).json()["data"] == []
    assert await client.beta.agents.vaults.retrieve(v) == vault
    assert await client.beta.agents.vaults.credentials.retrieve(c, vault_id=v) == credential


async def test_scopes_split_vault_reads_from_writes(stack: Stack) -> None:
    client = strict(stack)
    vault = await client.beta.agents.vaults.create()
    credential = await client.beta.agents.vaults.credentials.create(
        vault.id, name="c", auth={"type": "static_bearer", "token": "t", "mcp_server_url": MCP_URL}
    )
    v, c = vault.id, credential.id
    writes: list[tuple[str, str, dict[str, Any] | None]] = [
        ("POST", "/vaults", {}),
        ("POST", f"/vaults/{v}", {"name": "n"}),
        ("DELETE", f"/vaults/{v}", None),
        ("POST", f"/vaults/{v}/credentials", {"name": "x", "auth": {"type": "static_bearer", "token": "t", "mcp_server_url": MCP_URL}}),
        ("POST", f"/vaults/{v}/credentials/{c}", {"metadata": {}}),
        ("DELETE", f"/vaults/{v}/credentials/{c}", None),
    ]
    reads = ["/vaults", f"/vaults/{v}", f"/vaults/{v}/credentials", f"/vaults/{v}/credentials/{c}"]
    async with stack.http(await stack.new_key("org-a", ("tasks:read",))) as reader:
        for method, path, body in writes:
            assert_error(await reader.request(method, path, json=body), 403, "insufficient_scopes")
        for path in reads:
            assert (await reader.get(path)).status_code == 200, path
    async with stack.http(await stack.new_key("org-a", ("tasks:write",))) as writer:
        for path in reads:
            assert_error(await writer.get(path), 403, "insufficient_scopes")
    assert await client.beta.agents.vaults.credentials.retrieve(c, vault_id=v) == credential
