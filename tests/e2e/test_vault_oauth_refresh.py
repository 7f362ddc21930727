"""An ``mcp_oauth`` vault credential whose access token has expired, used
by a service-origin MCP server on 127.0.0.1 that accepts only the
refreshed token: Berth refreshes it at connection time against an https
token endpoint on 127.0.0.1 (one grant for two sessions connecting at
once, the rotated refresh token used by the next grant), a failing refresh
fails the MCP call clearly and never as a 5xx, bad refresh configuration
is a 400 that stores nothing, and no token or secret appears in any
response, item, event, log line or file."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio
from e2e_stack import Stack, start_stack
from e2e_support import api_error, next_turn_end
from mcp_test_support import http_mcp_server
from oauth_support import Grant, LocalCA, TokenServer, make_test_ca, token_server
from openai.types.beta.agent_mcp_call_item import AgentMcpCallItem

from services.core.logging import capture_json_logs

pytestmark = pytest.mark.asyncio(loop_scope="module")

EXPIRED = "e2e-oauth-expired-access-0c6a"
ACCESS = "e2e-oauth-refreshed-access-b41f"
REFRESH_1, REFRESH_2, REFRESH_3 = "e2e-oauth-refresh-one-8d2e", "e2e-oauth-refresh-two-51c7", "e2e-oauth-refresh-three-e90a"
CLIENT_SECRET = "e2e-oauth-client-secret-37b5"
SECRETS = (EXPIRED, ACCESS, REFRESH_1, REFRESH_2, REFRESH_3, CLIENT_SECRET)
PAST = "2020-01-01T00:00:00Z"


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> LocalCA:
    return make_test_ca(tmp_path_factory.mktemp("oauth-ca"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory, ca: LocalCA) -> AsyncIterator[Stack]:
    # The token endpoints of these tests are on 127.0.0.1, under the test CA.
    s, stop = await start_stack(
        tmp_path_factory.mktemp("oauth") / "berth",
        oauth_allow_private_endpoints=True,
        outbound_ca_bundle=str(ca.bundle),
    )
    try:
        yield s
    finally:
        await stop()  # type: ignore[misc]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mcp_url() -> AsyncIterator[str]:
    """The MCP server, accepting only the access token the refresh issues."""
    async with http_mcp_server(required_bearer=ACCESS) as url:
        yield url


@pytest.fixture
def server(ca: LocalCA) -> Iterator[TokenServer]:
    with token_server(
        ca,
        client_id="berth-e2e",
        client_secret=CLIENT_SECRET,
        auth_method="client_secret_basic",
        refresh_token=REFRESH_1,
        # The server reissues the one access token the MCP server accepts,
        # each time with a new refresh token.
        grants=[Grant(ACCESS, REFRESH_2), Grant(ACCESS, REFRESH_3)],
        # Two connections not serialized by Berth would both arrive meanwhile.
        hold_for_second_s=0.5,
    ) as s:
        yield s


def strict(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=stack.base_url, api_key=stack.key, max_retries=0, timeout=60, _strict_response_validation=True
    )


def oauth_auth(server: TokenServer, mcp_url: str, **refresh: Any) -> dict[str, Any]:
    return {
        "type": "mcp_oauth",
        "access_token": EXPIRED,
        "expires_at": PAST,
        "mcp_server_url": mcp_url,
        "refresh": {
            "client_id": server.client_id,
            "refresh_token": REFRESH_1,
            "token_endpoint": server.url,
            "token_endpoint_auth": {"type": "client_secret_basic", "client_secret": CLIENT_SECRET},
            **refresh,
        },
    }


def remote(url: str) -> dict[str, Any]:
    return {"type": "mcp", "server_label": "remote", "transport": {"type": "http", "server_url": url}}


ECHO = 'mcp remote.echo {"text": "authorized"}'


async def session_with(client: openai.AsyncOpenAI, vault_id: str, url: str) -> str:
    """A session without an environment whose first turn calls ``remote.echo``."""
    session = await client.post(
        "/agents/sessions",
        body={
            "agent": {"model": "scripted", "tools": [remote(url)]},
            "environment": {"type": "none"},
            "vault_ids": [vault_id],
            "input": ECHO,
        },
        cast_to=dict[str, Any],
        options={"headers": {"OpenAI-Beta": "agents=v1"}},
    )
    return str(session["id"])


async def echo_call(client: openai.AsyncOpenAI, session_id: str) -> tuple[str, AgentMcpCallItem | None]:
    """The status of the session's first turn and its MCP call item (None if there was none)."""
    turn = await next_turn_end(client, session_id, set(), timeout=60)
    items = [i async for i in client.beta.agents.sessions.turns.items.list(turn.id, session_id=session_id)]
    calls = [i for i in items if isinstance(i, AgentMcpCallItem)]
    return turn.status, (calls[0] if calls else None)


async def everything_visible(stack: Stack, session_ids: list[str], vault_id: str) -> str:
    bodies: list[str] = []
    async with stack.http() as http:
        for session_id in session_ids:
            for path in (f"/agents/sessions/{session_id}", f"/agents/sessions/{session_id}/items", f"/agents/sessions/{session_id}/turns"):
                bodies.append((await http.get(path)).text)
            async with http.stream("GET", f"/agents/sessions/{session_id}/events", headers={"Last-Event-ID": "0"}) as events:
                async for line in events.aiter_lines():
                    bodies.append(line)
                    if "turn.completed" in line or "turn.failed" in line:
                        break
        bodies.append((await http.get(f"/vaults/{vault_id}/credentials")).text)
    return "\n".join(bodies)


async def test_an_expired_token_is_refreshed_once_for_two_connections_and_no_secret_leaks(
    stack: Stack, server: TokenServer, mcp_url: str
) -> None:
    client = strict(stack)
    url = mcp_url
    logs = io.StringIO()
    with capture_json_logs(logs, level="DEBUG"):
        vault = await client.beta.agents.vaults.create(name="oauth")
        created = await client.beta.agents.vaults.credentials.create(
            vault.id, name="remote", auth=oauth_auth(server, url, scope="tools")  # type: ignore[arg-type]
        )
        assert created.auth.type == "mcp_oauth" and created.auth.refresh is not None
        assert created.auth.refresh.model_dump() == {
            "client_id": "berth-e2e",
            "token_endpoint": server.url,
            "token_endpoint_auth": {"type": "client_secret_basic"},
            "resource": None,
            "scope": "tools",
        }
        server.expect_scope = "tools"
        first, second = [await session_with(client, vault.id, url) for _ in range(2)]
        results = await asyncio.gather(echo_call(client, first), echo_call(client, second))
        for status, call in results:
            assert status == "completed" and call is not None
            assert (call.status, call.output) == ("completed", "authorized")
        assert server.presented == [REFRESH_1] and server.refused == []

        refreshed = await client.beta.agents.vaults.credentials.retrieve(created.id, vault_id=vault.id)
        assert refreshed.auth.type == "mcp_oauth" and (refreshed.auth.expires_at or "") > "2026"

        # Expired again: the next grant spends the refresh token the first rotated in.
        server.hold_for_second_s = 0
        await client.beta.agents.vaults.credentials.update(
            created.id, vault_id=vault.id, auth={"type": "mcp_oauth", "expires_at": PAST}
        )
        third = await session_with(client, vault.id, url)
        status, call = await echo_call(client, third)
        assert call is not None and (call.status, call.output) == ("completed", "authorized")
        assert server.presented == [REFRESH_1, REFRESH_2] and server.refused == []
        visible = await everything_visible(stack, [first, second, third], vault.id)
    assert "authorized" in visible and "vault_credential_refreshed" in logs.getvalue()
    for secret in SECRETS:
        assert secret not in visible, secret
        assert secret not in logs.getvalue(), secret
    for path in stack.data_dir.rglob("*"):
        if path.is_file() and path.suffix != ".sock":
            data = path.read_bytes()
            for secret in SECRETS:
                assert secret.encode() not in data, (path, secret)


async def test_a_failing_refresh_fails_the_mcp_call_clearly_and_never_as_a_5xx(
    stack: Stack, server: TokenServer, mcp_url: str
) -> None:
    client = strict(stack)
    url = mcp_url
    server.mode = "invalid_grant"
    server.hold_for_second_s = 0
    logs = io.StringIO()
    with capture_json_logs(logs, level="DEBUG"):
        vault = await client.beta.agents.vaults.create(name="failing")
        credential = await client.beta.agents.vaults.credentials.create(
            vault.id, name="remote", auth=oauth_auth(server, url)  # type: ignore[arg-type]
        )
        session_id = await session_with(client, vault.id, url)
        status, call = await echo_call(client, session_id)
        visible = await everything_visible(stack, [session_id], vault.id)
    assert server.refused == [REFRESH_1] and server.presented == []
    assert call is None or call.status != "completed"
    assert status in ("completed", "failed")
    assert "invalid_grant" in visible and credential.id in visible
    assert "vault_credential_refresh_failed" in logs.getvalue()
    for secret in SECRETS:
        assert secret not in visible and secret not in logs.getvalue(), secret


INVALID: list[tuple[str, dict[str, Any], str]] = [
    (
        "client_secret_basic without a client secret",
        {"token_endpoint_auth": {"type": "client_secret_basic"}},
        "auth.refresh.token_endpoint_auth.client_secret",
    ),
    (
        "none with a client secret",
        {"token_endpoint_auth": {"type": "none", "client_secret": CLIENT_SECRET}},
        "auth.refresh.token_endpoint_auth.client_secret",
    ),
    ("an http token endpoint", {"token_endpoint": "http://auth.example.test/token"}, "auth.refresh.token_endpoint"),
    ("no refresh token", {"refresh_token": None}, "auth.refresh.refresh_token"),
]


@pytest.mark.parametrize(("case", "refresh", "param"), INVALID, ids=[c for c, _, _ in INVALID])
async def test_bad_refresh_configuration_is_a_400_naming_the_param_and_stores_nothing(
    stack: Stack, server: TokenServer, case: str, refresh: dict[str, Any], param: str
) -> None:
    client = strict(stack)
    vault = await client.beta.agents.vaults.create()
    auth = oauth_auth(server, "https://mcp.example.test/mcp", **refresh)
    auth["refresh"] = {k: v for k, v in auth["refresh"].items() if v is not None}
    refused = await api_error(client.beta.agents.vaults.credentials.create(vault.id, name="x", auth=auth))  # type: ignore[arg-type]
    assert (refused.status_code, refused.code) == (400, "validation_error")
    assert refused.body["param"] == param  # type: ignore[index]
    assert [c async for c in client.beta.agents.vaults.credentials.list(vault.id)] == []
    assert server.calls == 0 and CLIENT_SECRET not in str(refused.body)


async def test_a_rotation_replaces_the_refresh_token_client_secret_and_scope_and_the_next_refresh_uses_them(
    stack: Stack, server: TokenServer, mcp_url: str
) -> None:
    client = strict(stack)
    credentials = client.beta.agents.vaults.credentials
    vault = await client.beta.agents.vaults.create(name="rotating")
    created = await credentials.create(vault.id, name="remote", auth=oauth_auth(server, mcp_url, scope="tools"))  # type: ignore[arg-type]
    wrong = await api_error(
        credentials.update(
            created.id,
            vault_id=vault.id,
            auth={"type": "mcp_oauth", "refresh": {"token_endpoint_auth": {"type": "client_secret_post", "client_secret": "x"}}},
        )
    )
    assert (wrong.status_code, wrong.body["param"]) == (400, "auth.refresh.token_endpoint_auth.type")  # type: ignore[index]

    server.hold_for_second_s = 0
    server.refresh_token, server.client_secret = REFRESH_3, "e2e-oauth-client-secret-rotated-2f"
    rotated = await credentials.update(
        created.id,
        vault_id=vault.id,
        auth={
            "type": "mcp_oauth",
            "refresh": {
                "refresh_token": REFRESH_3,
                "scope": None,
                "token_endpoint_auth": {"type": "client_secret_basic", "client_secret": server.client_secret},
            },
        },
    )
    assert rotated.auth.type == "mcp_oauth" and rotated.auth.refresh is not None and rotated.auth.refresh.scope is None
    assert rotated.auth.expires_at == PAST
    status, call = await echo_call(client, await session_with(client, vault.id, mcp_url))
    assert call is not None and (call.status, call.output) == ("completed", "authorized")
    assert server.presented == [REFRESH_3]

    plain = await credentials.create(
        vault.id, name="plain", auth={"type": "mcp_oauth", "access_token": "a", "mcp_server_url": "https://mcp.example.test/"}
    )
    refused = await api_error(
        credentials.update(plain.id, vault_id=vault.id, auth={"type": "mcp_oauth", "refresh": {"refresh_token": "r"}})
    )
    assert (refused.status_code, refused.body["param"]) == (400, "auth.refresh")  # type: ignore[index]
