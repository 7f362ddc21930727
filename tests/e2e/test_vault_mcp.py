"""A vault credential used by a service-origin MCP server on 127.0.0.1 that
requires its bearer token: the Session service injects it at connection
time from the session's own vaults, and the token appears in no item,
event, API response, log line or database file."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
from e2e_stack import Stack, start_stack
from e2e_support import attach_session, create_environment, run_script
from mcp_test_support import http_mcp_server
from openai.types.beta.agent_mcp_call_item import AgentMcpCallItem

from services.core.logging import capture_json_logs

TOKEN = "vault-mcp-bearer-e5d04b7a19c3"


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    s, stop = await start_stack(tmp_path / "berth")
    try:
        yield s
    finally:
        await stop()  # type: ignore[misc]


def remote(url: str, **options: Any) -> dict[str, Any]:
    return {"type": "mcp", "server_label": "remote", "transport": {"type": "http", "server_url": url}, **options}


async def echo_call(client: openai.AsyncOpenAI, session_id: str) -> AgentMcpCallItem | None:
    """Runs ``remote.echo`` in a turn; its call item (None if there was none)."""
    turn = await run_script(client, session_id, 'mcp remote.echo {"text": "authorized"}', timeout=60)
    items = [i async for i in client.beta.agents.sessions.turns.items.list(turn.id, session_id=session_id)]
    calls = [i for i in items if isinstance(i, AgentMcpCallItem)]
    return calls[0] if calls else None


async def everything_visible(stack: Stack, session_ids: list[str], vault_id: str) -> str:
    """Every API body an application can read about these sessions and the vault."""
    bodies: list[str] = []
    async with stack.http() as http:
        for session_id in session_ids:
            for path in (
                f"/agents/sessions/{session_id}",
                f"/agents/sessions/{session_id}/items",
                f"/agents/sessions/{session_id}/turns",
            ):
                bodies.append((await http.get(path)).text)
            async with http.stream("GET", f"/agents/sessions/{session_id}/events", headers={"Last-Event-ID": "0"}) as events:
                async for line in events.aiter_lines():
                    bodies.append(line)
                    if "turn.completed" in line or "turn.failed" in line:
                        break
        bodies.append((await http.get(f"/vaults/{vault_id}/credentials")).text)
    return "\n".join(bodies)


async def _use_the_vault_bearer(stack: Stack, client: Any) -> None:
    env = await create_environment(client)
    async with http_mcp_server(required_bearer=TOKEN) as url:
        vault = await client.beta.agents.vaults.create(name="mcp")
        credential = await client.beta.agents.vaults.credentials.create(
            vault.id, name="remote", auth={"type": "static_bearer", "token": TOKEN, "mcp_server_url": url}
        )
        named = await attach_session(
            client, env.id, vault_ids=[vault.id], agent={"model": "scripted", "tools": [remote(url, credential_id=credential.id)]}
        )
        call = await echo_call(client, named.id)
        assert call is not None and (call.status, call.output) == ("completed", "authorized")

        # Without credential_id, the one credential whose URL matches is used.
        matched = await attach_session(client, env.id, vault_ids=[vault.id], agent={"model": "scripted", "tools": [remote(url)]})
        call = await echo_call(client, matched.id)
        assert call is not None and (call.status, call.output) == ("completed", "authorized")

        # A session without the vault gets no credential: the server refuses it.
        # Sharing the environment does not share the other sessions' vaults.
        bare = await attach_session(client, env.id, agent={"model": "scripted", "tools": [remote(url, credential_id=credential.id)]})
        call = await echo_call(client, bare.id)
        assert call is None or call.output != "authorized"

        visible = await everything_visible(stack, [named.id, matched.id, bare.id], vault.id)
        assert "authorized" in visible
        assert TOKEN not in visible


async def test_a_vault_bearer_reaches_the_mcp_server_and_nothing_else(stack: Stack) -> None:
    client = stack.aclient()
    logs = io.StringIO()
    with capture_json_logs(logs, level="DEBUG"):
        await _use_the_vault_bearer(stack, client)
    assert "vault_credential_created" in logs.getvalue()
    assert TOKEN not in logs.getvalue()
    for path in stack.data_dir.rglob("*"):
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), path


async def test_replacing_a_sessions_vaults_changes_the_credential_its_next_turn_connects_with(stack: Stack) -> None:
    client = stack.aclient()
    sessions = client.beta.agents.sessions
    env = await create_environment(client)
    async with http_mcp_server(required_bearer=TOKEN) as url:
        vault = await client.beta.agents.vaults.create(name="mcp")
        await client.beta.agents.vaults.credentials.create(
            vault.id, name="remote", auth={"type": "static_bearer", "token": TOKEN, "mcp_server_url": url}
        )
        session = await attach_session(client, env.id, vault_ids=[vault.id], agent={"model": "scripted", "tools": [remote(url)]})
        call = await echo_call(client, session.id)
        assert call is not None and (call.status, call.output) == ("completed", "authorized")

        # Cleared: the open connection is not reused, and the server refuses the next one.
        cleared = await sessions.update(session.id, vault_ids=[])
        assert cleared.vault_ids == []
        call = await echo_call(client, session.id)
        assert call is None or call.output != "authorized"

        restored = await sessions.update(session.id, vault_ids=[vault.id])
        assert restored.vault_ids == [vault.id]
        call = await echo_call(client, session.id)
        assert call is not None and (call.status, call.output) == ("completed", "authorized")

        # Another organization's vault is a 404 there and changes nothing.
        other = stack.aclient(await stack.new_key())
        foreign = await other.beta.agents.vaults.create(name="theirs")
        async with stack.http() as http:
            refused = await http.post(f"/agents/sessions/{session.id}", json={"vault_ids": [foreign.id]})
            assert refused.status_code == 404, refused.text
            assert refused.json()["error"]["param"] == "vault_ids"
        assert (await sessions.retrieve(session.id)).vault_ids == [vault.id]

        # A session's inline environment took its vaults for its secrets when
        # its sandbox was made: they cannot change there (the same set can).
        inline = await sessions.create(agent={"model": "scripted"}, environment={"type": "openai_hosted"}, vault_ids=[vault.id])
        async with stack.http() as http:
            refused = await http.post(f"/agents/sessions/{inline.id}", json={"vault_ids": []})
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] == "vault_ids"
        assert (await sessions.update(inline.id, vault_ids=[vault.id])).vault_ids == [vault.id]
        assert (await sessions.retrieve(inline.id)).vault_ids == [vault.id]
