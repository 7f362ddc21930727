"""MCP tools end to end: the official SDK against the gateway, the scripted
model calling a real MCP server written with the official ``mcp`` package,
as a stdio process inside a real sandbox and over streamable HTTP on
127.0.0.1 (seed 001, "MCP names and reuse" and "Lifetime and cleanup")."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
from e2e_stack import Stack, start_stack
from e2e_support import (
    api_error,
    attach_session,
    create_environment,
    delete_environment,
    next_turn_end,
    run_script,
    send_script,
)
from hosts_support import TestHost
from mcp_test_support import COUNT_SERVERS, SANDBOX_MOUNTS, http_mcp_server, require_host_python_mcp, stdio_transport
from openai.types.beta.agent_mcp_call_item import AgentMcpCallItem
from openai.types.beta.agent_session import AgentSession
from openai.types.beta.agents.sessions.turn import Turn
from grpc_support import internal_channel
from waiting import wait_until

from berth.environment.v1 import environment_pb2, environment_service_pb2, environment_service_pb2_grpc
from services.cli import main as berth_main


@pytest.fixture
async def stack(tmp_path: Path, bwrap_available: None, test_host: TestHost) -> AsyncIterator[Stack]:
    """The whole stack, with the test MCP server and the venv's site-packages
    mounted read-only into every sandbox, whose network reaches the test host."""
    require_host_python_mcp()
    s, stop = await start_stack(tmp_path / "berth", sandbox_extra_ro_mounts=SANDBOX_MOUNTS, sandbox_allow_cidrs=[test_host.cidr])
    try:
        yield s
    finally:
        await stop()  # type: ignore[misc]


def mcp_tool(label: str, transport: dict[str, Any], **options: Any) -> dict[str, Any]:
    return {"type": "mcp", "server_label": label, "transport": transport, **options}


async def session_on(client: openai.AsyncOpenAI, environment_id: str, *tools: dict[str, Any]) -> AgentSession:
    return await attach_session(client, environment_id, agent={"model": "scripted", "tools": list(tools)})


async def mcp_calls(client: openai.AsyncOpenAI, session_id: str, turn: Turn) -> list[AgentMcpCallItem]:
    items = [i async for i in client.beta.agents.sessions.turns.items.list(turn.id, session_id=session_id, order="asc")]
    return [i for i in items if isinstance(i, AgentMcpCallItem)]


async def one_call(client: openai.AsyncOpenAI, session_id: str, script: str) -> AgentMcpCallItem:
    turn = await run_script(client, session_id, script, timeout=60)
    assert turn.status == "completed", turn.error
    [call] = await mcp_calls(client, session_id, turn)
    return call


async def command_output(client: openai.AsyncOpenAI, session_id: str, command: str) -> str:
    turn = await run_script(client, session_id, f"$ {command}")
    items = [i async for i in client.beta.agents.sessions.turns.items.list(turn.id, session_id=session_id)]
    [execution] = [i for i in items if i.type == "command_execution"]
    return str(execution.output)  # type: ignore[union-attr]


async def list_servers(stack: Stack, environment_id: str) -> dict[str, environment_pb2.McpServer]:
    """ListMcpServers over gRPC, as the organization behind the stack's key."""
    from gateway.keys import list_keys

    org_id = (await list_keys(stack.database, "org-a"))[0].org_id  # type: ignore[arg-type]
    async with internal_channel(stack.settings.environment_addr) as channel:
        stub = environment_service_pb2_grpc.EnvironmentServiceStub(channel)
        response = await stub.ListMcpServers(
            environment_service_pb2.ListMcpServersRequest(environment_id=environment_id), metadata=(("x-berth-org", org_id),)
        )
    return {s.label: s for s in response.servers}


async def test_a_later_session_configuring_reader_receives_the_first_sessions_server(stack: Stack) -> None:
    client = stack.aclient()
    env = await create_environment(client)
    a = await session_on(client, env.id, mcp_tool("reader", stdio_transport(READER_VALUE="A")))
    b = await session_on(client, env.id, mcp_tool("reader", stdio_transport(READER_VALUE="B")))

    first = await one_call(client, a.id, "mcp reader.reader")
    assert (first.server_label, first.name, first.arguments, first.output, first.error, first.status) == (
        "reader",
        "reader",
        {},
        "A",
        None,
        "completed",
    )
    assert (await one_call(client, b.id, "mcp reader.reader")).output == "A"
    servers = await list_servers(stack, env.id)
    assert servers["reader"].owner_session_id == a.id and list(servers["reader"].session_ids) == [a.id, b.id]


async def test_twenty_concurrent_calls_from_two_sessions_through_one_broker_get_their_own_responses(stack: Stack) -> None:
    client = stack.aclient()
    env = await create_environment(client)
    sessions = [await session_on(client, env.id, mcp_tool("echo", stdio_transport())) for _ in range(2)]

    def script(prefix: str) -> str:
        # One model response with ten calls; each answers only once all
        # twenty calls of both sessions are in flight at the server together.
        arguments = [{"key": env.id, "n": 20, "text": f"{prefix}-{i}"} for i in range(10)]
        lines = [f"mcp echo.rendezvous {json.dumps(a)}" for a in arguments]
        return "\n".join(lines[:1] + [f"& {line}" for line in lines[1:]])

    turns = await asyncio.gather(*(run_script(client, s.id, script(s.id), timeout=60) for s in sessions))
    for session, turn in zip(sessions, turns):
        assert turn.status == "completed", turn.error
        calls = await mcp_calls(client, session.id, turn)
        assert [(c.status, c.output) for c in calls] == [("completed", f"{session.id}-{i}") for i in range(10)]
    assert (await command_output(client, sessions[0].id, COUNT_SERVERS)).strip() == "1"


async def test_concurrent_first_starts_from_two_sessions_run_exactly_one_server_process(stack: Stack) -> None:
    client = stack.aclient()
    env = await create_environment(client)
    a = await session_on(client, env.id, mcp_tool("reader", stdio_transport(READER_VALUE="A")))
    b = await session_on(client, env.id, mcp_tool("reader", stdio_transport(READER_VALUE="B")))
    calls = await asyncio.gather(one_call(client, a.id, "mcp reader.reader"), one_call(client, b.id, "mcp reader.reader"))
    values = {c.output for c in calls}
    assert len(values) == 1 and values <= {"A", "B"}
    assert (await command_output(client, a.id, COUNT_SERVERS)).strip() == "1"
    owner = (await list_servers(stack, env.id))["reader"].owner_session_id
    assert owner == (a.id if values == {"A"} else b.id)


async def test_after_the_server_dies_calls_fail_cleanly_and_it_is_not_restarted_with_a_later_configuration(
    stack: Stack,
) -> None:
    client = stack.aclient()
    env = await create_environment(client)
    a = await session_on(client, env.id, mcp_tool("reader", stdio_transport(READER_VALUE="A")))
    pid = (await one_call(client, a.id, "mcp reader.pid")).output
    await command_output(client, a.id, f"kill -9 {pid}")

    async def dead() -> bool:
        return (await list_servers(stack, env.id))["reader"].state == environment_pb2.MCP_SERVER_STATE_DEAD

    await wait_until(dead, timeout=15, what="the reader server to be reported dead")
    failed = await one_call(client, a.id, "mcp reader.reader")
    assert failed.status == "failed" and isinstance(failed.error, str) and failed.output is None

    b = await session_on(client, env.id, mcp_tool("reader", stdio_transport(READER_VALUE="B")))
    later = await one_call(client, b.id, "mcp reader.reader")
    assert later.status == "failed" and later.error
    assert (await command_output(client, b.id, COUNT_SERVERS)).strip() == "0"
    assert (await list_servers(stack, env.id))["reader"].state == environment_pb2.MCP_SERVER_STATE_DEAD


async def test_after_a_session_is_deleted_peers_still_reach_its_stdio_server_with_its_launch_environment(stack: Stack) -> None:
    client = stack.aclient()
    env = await create_environment(client, env={"SANDBOX_TOKEN": "tok-1"})
    owner_config = stdio_transport(("SANDBOX_TOKEN",), READER_VALUE="A", SECRET="from-a")
    a = await session_on(client, env.id, mcp_tool("reader", owner_config))
    b = await session_on(client, env.id, mcp_tool("reader", stdio_transport(READER_VALUE="B", SECRET="from-b")))
    pid = (await one_call(client, a.id, "mcp reader.pid")).output

    await client.beta.agents.sessions.delete(a.id)

    assert (await one_call(client, b.id, "mcp reader.reader")).output == "A"
    assert (await one_call(client, b.id, 'mcp reader.env {"name": "SECRET"}')).output == "from-a"
    assert (await one_call(client, b.id, 'mcp reader.env {"name": "SANDBOX_TOKEN"}')).output == "tok-1"
    assert (await one_call(client, b.id, "mcp reader.pid")).output == pid
    server = (await list_servers(stack, env.id))["reader"]
    assert server.owner_session_id == a.id and list(server.session_ids) == [b.id]


async def test_deleting_a_session_closes_the_environment_origin_http_upstream_its_peers_reuse(
    stack: Stack, test_host: TestHost
) -> None:
    client = stack.aclient()
    env = await create_environment(client)
    async with http_mcp_server(test_host) as url:
        remote = mcp_tool("remote", {"type": "http", "server_url": url, "headers": {"X-Berth-Test": "a"}}, connection_origin="environment")
        a = await session_on(client, env.id, remote)
        b = await session_on(client, env.id, {**remote, "transport": {"type": "http", "server_url": url, "headers": {"X-Berth-Test": "b"}}})
        assert (await one_call(client, a.id, 'mcp remote.header {"name": "x-berth-test"}')).output == "a"
        assert (await one_call(client, b.id, 'mcp remote.header {"name": "x-berth-test"}')).output == "a"
        assert (await one_call(client, b.id, "mcp remote.initialize_count")).output == "1"

        await client.beta.agents.sessions.delete(a.id)

        # The shared upstream session was ended (this affects the peer, as the
        # seeds warn); its next call opens a fresh upstream session.
        assert (await one_call(client, b.id, "mcp remote.initialize_count")).output == "2"
        assert (await list_servers(stack, env.id))["remote"].transport_type == environment_pb2.MCP_TRANSPORT_TYPE_HTTP


async def test_a_service_origin_http_server_round_trips_per_session_with_its_own_credentials(stack: Stack) -> None:
    client = stack.aclient()
    env = await create_environment(client)
    async with http_mcp_server() as url:
        tool = mcp_tool("remote", {"type": "http", "server_url": url, "authorization": "tok-a", "headers": {"X-Berth-Test": "a"}})
        session = await session_on(client, env.id, tool)
        echoed = await one_call(client, session.id, 'mcp remote.echo {"text": "over http"}')
        assert (echoed.output, echoed.arguments, echoed.status) == ("over http", {"text": "over http"}, "completed")
        assert (await one_call(client, session.id, 'mcp remote.header {"name": "authorization"}')).output == "Bearer tok-a"
        assert (await one_call(client, session.id, 'mcp remote.header {"name": "x-berth-test"}')).output == "a"
        # One connection per session, kept across turns.
        assert (await one_call(client, session.id, "mcp remote.initialize_count")).output == "1"

        # Sharing the environment shares neither the connection nor its credentials.
        other = await session_on(client, env.id, mcp_tool("remote", {"type": "http", "server_url": url, "headers": {"X-Berth-Test": "b"}}))
        assert (await one_call(client, other.id, 'mcp remote.header {"name": "x-berth-test"}')).output == "b"
        assert (await one_call(client, other.id, 'mcp remote.header {"name": "authorization"}')).output == "<unset>"
        assert (await one_call(client, other.id, "mcp remote.initialize_count")).output == "2"
    # Service-origin MCP runs outside the sandbox: the environment was never started.
    assert (await client.beta.agents.environments.retrieve(env.id)).status == "pending"
    assert await list_servers(stack, env.id) == {}


async def test_allowed_tools_limit_what_a_session_can_call(stack: Stack) -> None:
    client = stack.aclient()
    env = await create_environment(client)
    session = await session_on(client, env.id, mcp_tool("reader", stdio_transport(READER_VALUE="A"), allowed_tools=["reader"]))
    assert (await one_call(client, session.id, "mcp reader.reader")).output == "A"
    refused = await one_call(client, session.id, 'mcp reader.echo {"text": "x"}')
    assert refused.status == "failed" and refused.error and refused.output is None


async def test_cancelling_a_turn_stops_its_in_flight_mcp_call_and_keeps_the_connection(stack: Stack) -> None:
    client = stack.aclient()
    env = await create_environment(client)
    session = await session_on(client, env.id, mcp_tool("reader", stdio_transport()))
    known = await send_script(client, session.id, 'mcp reader.echo {"text": "late", "delay_s": 120}')

    async def in_flight() -> bool:
        items = [i async for i in client.beta.agents.sessions.items.list(session.id)]
        return any(isinstance(i, AgentMcpCallItem) and i.status == "in_progress" for i in items)

    await wait_until(in_flight, timeout=60, what="the MCP call to start")
    await client.beta.agents.sessions.events.create(session.id, events=[{"type": "agent.session.input.cancel"}])
    turn = await next_turn_end(client, session.id, known)
    assert turn.status == "cancelled"
    [call] = await mcp_calls(client, session.id, turn)
    assert call.status == "incomplete"
    assert (await one_call(client, session.id, 'mcp reader.echo {"text": "next"}')).output == "next"


async def test_a_required_server_that_fails_to_start_fails_the_turn(stack: Stack) -> None:
    client = stack.aclient()
    env = await create_environment(client)
    broken = {"type": "stdio", "command": "/bin/sh", "cwd": "/workspace", "args": ["-c", "exit 3"]}
    session = await session_on(client, env.id, mcp_tool("broken", broken, required=True))
    turn = await run_script(client, session.id, "hello", timeout=60)
    assert turn.status == "failed" and turn.error is not None and turn.error.code == "mcp_server_error"  # type: ignore[comparison-overlap]  # a Berth code
    items = [i async for i in client.beta.agents.sessions.turns.items.list(turn.id, session_id=session.id)]
    assert [i.type for i in items] == ["message"]  # the model was never called

    # Not required: the turn goes on, and a call to it fails as an item.
    optional = await session_on(client, env.id, mcp_tool("missing", {**broken, "args": ["-c", "exit 4"]}))
    call = await one_call(client, optional.id, "mcp missing.anything")
    assert call.status == "failed" and call.error


async def test_mcp_call_items_parse_in_the_official_sdk_with_strict_validation(stack: Stack) -> None:
    client = stack.aclient()
    env = await create_environment(client)
    session = await session_on(client, env.id, mcp_tool("reader", stdio_transport(READER_VALUE="A")))
    turn = await run_script(client, session.id, 'mcp reader.echo {"text": "hi"}\nmcp reader.nope', timeout=60)
    strict = openai.AsyncOpenAI(base_url=stack.base_url, api_key=stack.key, max_retries=0, _strict_response_validation=True)
    items = [i async for i in strict.beta.agents.sessions.items.list(session.id, order="asc")]
    calls = [i for i in items if isinstance(i, AgentMcpCallItem)]
    assert [(c.name, c.status) for c in calls] == [("echo", "completed"), ("nope", "failed")]
    assert calls[0].turn_id == turn.id and calls[0].output == "hi" and calls[0].error is None
    raw = await stack.http().get(f"/agents/sessions/{session.id}/items", params={"order": "asc"})
    for item in raw.json()["data"]:
        if item["type"] == "mcp_call":
            assert {"id", "server_label", "name", "arguments", "output", "error", "status", "turn_id"} <= set(item)
            AgentMcpCallItem.model_validate(item, strict=False)
    await strict.close()


async def test_berth_mcp_list_prints_label_origin_owner_session_and_state(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    client = stack.aclient()
    env = await create_environment(client)
    session = await session_on(client, env.id, mcp_tool("reader", stdio_transport(READER_VALUE="A")))
    await one_call(client, session.id, "mcp reader.reader")
    monkeypatch.setenv("BERTH_DATA_DIR", str(stack.data_dir))
    monkeypatch.setenv("BERTH_ENVIRONMENT_ADDR", stack.settings.environment_addr)
    capsys.readouterr()

    assert await asyncio.to_thread(berth_main, ["mcp", "list", "--org", "org-a", "--environment", env.id]) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split() == ["LABEL", "ORIGIN", "TRANSPORT", "OWNER", "SESSION", "STATE"]
    assert row.split() == ["reader", "environment", "stdio", session.id, "running"]

    # Another organization sees nothing of it.
    await stack.new_key("org-b")
    assert await asyncio.to_thread(berth_main, ["mcp", "list", "--org", "org-b", "--environment", env.id]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err


async def test_an_environment_with_a_running_server_is_deleted_once_its_sessions_are(stack: Stack) -> None:
    client = stack.aclient()
    env = await create_environment(client)
    session = await session_on(client, env.id, mcp_tool("reader", stdio_transport(READER_VALUE="A")))
    await one_call(client, session.id, "mcp reader.reader")
    await client.beta.agents.sessions.delete(session.id)
    assert (await list_servers(stack, env.id))["reader"].state == environment_pb2.MCP_SERVER_STATE_RUNNING
    assert (await delete_environment(client, env.id))["deleted"] is True
    missing = await api_error(client.beta.agents.environments.retrieve(env.id))
    assert missing.status_code == 404
