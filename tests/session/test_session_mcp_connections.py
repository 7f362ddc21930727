"""Berth's MCP client side without a sandbox: the official ``ClientSession``
over the environment transport (each message through one ``send``
function, as SendMcpMessage does), and per-session connection lifetime."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from mcp.shared.exceptions import MCPError
from mcp_test_support import http_mcp_server

from services.core.errors import McpServerDead
from services.session.harness.io import McpUnavailable
from services.session.mcp_connections import UPSTREAM_ERROR, McpConnections, environment_transport, service_http_transport

Json = dict[str, Any]


class FakeBroker:
    """A minimal MCP server behind ``send``: one JSON-RPC message in, the
    response to a request out."""

    def __init__(self) -> None:
        self.received: list[Json] = []
        self.blocked = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.dead = False

    async def send(self, text: str) -> str:
        message = json.loads(text)
        self.received.append(message)
        if self.dead:
            # What the Environment service client raises for the broker's answer.
            raise McpServerDead("MCP server fake is dead; it is not restarted")
        method = message.get("method")
        if "id" not in message:
            return ""
        if method == "initialize":
            result: Json = {
                "protocolVersion": message["params"]["protocolVersion"],
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "fake", "version": "1"},
            }
        elif method == "tools/list":
            result = {"tools": [{"name": "echo", "inputSchema": {"type": "object"}}]}
        elif method == "tools/call":
            arguments = message["params"]["arguments"]
            if arguments.get("block"):
                self.blocked.set()
                try:
                    await asyncio.Event().wait()
                except asyncio.CancelledError:
                    self.cancelled.set()
                    raise
            # Later calls answer sooner, so responses return out of order.
            await asyncio.sleep(0.001 * (20 - int(arguments.get("n", 0))))
            result = {"content": [{"type": "text", "text": arguments["text"]}], "isError": False}
        else:
            result = {}
        return json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": result})


@pytest.fixture
async def connections() -> AsyncIterator[McpConnections]:
    pool = McpConnections(call_timeout_s=10, connect_timeout_s=10)
    yield pool
    await pool.close()


async def test_a_client_session_runs_over_one_send_function_with_concurrent_calls(connections: McpConnections) -> None:
    broker = FakeBroker()
    connection = await connections.connect("sess_a", "fake", "fp", lambda: environment_transport(broker.send, label="fake"))
    assert [t.name for t in connection.tools] == ["echo"]
    methods = [m.get("method") for m in broker.received]
    # The handshake's notification went out before the next request.
    assert methods[:3] == ["initialize", "notifications/initialized", "tools/list"]

    results = await asyncio.gather(*(connection.call_tool("echo", {"text": f"t{n}", "n": n}) for n in range(20)))
    assert [r.content[0].text for r in results] == [f"t{n}" for n in range(20)]  # type: ignore[union-attr]
    # Reused while its configuration is unchanged.
    assert await connections.connect("sess_a", "fake", "fp", lambda: environment_transport(broker.send, label="fake")) is connection


async def test_cancelling_a_call_cancels_its_send(connections: McpConnections) -> None:
    broker = FakeBroker()
    connection = await connections.connect("sess_a", "fake", "fp", lambda: environment_transport(broker.send, label="fake"))
    call = asyncio.ensure_future(connection.call_tool("echo", {"text": "never", "block": True}))
    await asyncio.wait_for(broker.blocked.wait(), 10)
    call.cancel()
    await asyncio.wait_for(broker.cancelled.wait(), 10)
    with pytest.raises(asyncio.CancelledError):
        await call
    # The connection stays usable, and the client's cancellation was not forwarded.
    assert (await connection.call_tool("echo", {"text": "after"})).content[0].text == "after"  # type: ignore[union-attr]
    assert "notifications/cancelled" not in [m.get("method") for m in broker.received]


async def test_a_message_the_environment_cannot_deliver_fails_that_request_with_its_reason(connections: McpConnections) -> None:
    broker = FakeBroker()
    connection = await connections.connect("sess_a", "fake", "fp", lambda: environment_transport(broker.send, label="fake"))
    broker.dead = True
    with pytest.raises(MCPError) as info:
        await connection.call_tool("echo", {"text": "x"})
    assert info.value.code == UPSTREAM_ERROR and info.value.data["reason"] == "MCP_SERVER_DEAD"

    with pytest.raises(McpUnavailable):
        await connections.connect("sess_b", "fake", "fp", lambda: environment_transport(broker.send, label="fake"))


async def test_service_origin_connections_are_per_session_and_closed_with_their_session(connections: McpConnections) -> None:
    async with http_mcp_server() as url:

        def opener(value: str) -> Any:
            return lambda: service_http_transport(url, {"X-Berth-Test": value}, read_timeout_s=10)

        a = await connections.connect("sess_a", "remote", "a", opener("a"))
        b = await connections.connect("sess_b", "remote", "b", opener("b"))
        assert a is not b
        header = await a.call_tool("header", {"name": "x-berth-test"})
        assert header.structured_content == {"result": "a"}
        assert (await b.call_tool("header", {"name": "x-berth-test"})).structured_content == {"result": "b"}

        await connections.close_session("sess_a")
        assert not a.alive and b.alive
        # A changed configuration replaces the session's connection.
        c = await connections.connect("sess_b", "remote", "c", opener("c"))
        assert c is not b and not b.alive
        assert (await c.call_tool("header", {"name": "x-berth-test"})).structured_content == {"result": "c"}
