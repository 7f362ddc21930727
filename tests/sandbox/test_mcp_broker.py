"""Environment-origin MCP brokers through the Sandbox service, with a real MCP
server (the official ``mcp`` package) inside a real bubblewrap sandbox.

The sandbox sees the host's /usr, so the host's /usr/bin/python3 runs the
server; the venv's site-packages, which provide ``mcp``, are bound read-only
at /opt/berth-site and put on PYTHONPATH. That needs the venv's Python to
have the same minor version (and so the same ABI for compiled dependencies
such as pydantic_core) as /usr/bin/python3.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import urllib.parse
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

import grpc
import pytest
from grpc_support import TEST_INTERNAL_TOKEN, internal_channel
from hosts_support import TestHost, free_port, free_port_on
from mcp_test_support import (
    HOST_PYTHON,
    SERVER_IN_SANDBOX,
    SERVER_SCRIPT,
    SERVERS_DIR,
    SITE_IN_SANDBOX,
    SITE_PACKAGES,
    http_mcp_server,
    require_host_python_mcp,
)
from waiting import wait_until

from berth.common.v1 import common_pb2
from berth.sandbox.v1 import sandbox_pb2, sandbox_service_pb2 as pb, sandbox_service_pb2_grpc
from services.core.db import open_database
from services.core.errors import reason_from_rpc_error
from services.core.grpc_server import start_grpc_server
from services.core.settings import Settings
from services.sandbox.backends.local import LocalBackend
from services.sandbox.egress import EgressOptions, EgressProxies
from services.sandbox.manager import SandboxManager
from services.sandbox.server import SANDBOX_CALLERS
from services.sandbox.servicer import SandboxServicer

ORG_A = (("x-berth-org", "org_a"),)
ORG_B = (("x-berth-org", "org_b"),)
MIGRATIONS = Path(__file__).resolve().parents[2] / "services" / "sandbox" / "migrations" / "versions"
PROTOCOL_VERSION = "2025-06-18"

Stub: TypeAlias = sandbox_service_pb2_grpc.SandboxServiceStub
Json = dict[str, Any]


@pytest.fixture(scope="session")
def host_python_runs_mcp() -> None:
    """The server's interpreter must import the venv's ``mcp`` and its
    compiled dependencies."""
    require_host_python_mcp()


@dataclass
class Service:
    stub: Stub
    address: str


@pytest.fixture
async def service(
    tmp_path: Path, bwrap_available: None, host_python_runs_mcp: None, test_host: TestHost
) -> AsyncIterator[Service]:
    """The Sandbox service composed like ``start_sandbox_service``, with a
    backend that mounts the site-packages and the test server, whose enabled
    sandboxes may reach the test host."""
    async with serve(tmp_path, test_host) as running:
        yield running


@contextlib.asynccontextmanager
async def serve(tmp_path: Path, test_host: TestHost) -> AsyncIterator[Service]:
    """One run of the Sandbox service over the data dir in ``tmp_path``: a
    later run adopts the sandboxes an earlier one left."""
    settings = Settings(data_dir=tmp_path / "berth", sandbox_idle_pause_s=0)
    db = await open_database(settings.database_url("sandbox"), "sandbox", MIGRATIONS)
    backend = LocalBackend(
        settings.data_dir.resolve(),
        "bwrap",
        extra_ro_mounts={SITE_PACKAGES: SITE_IN_SANDBOX, SERVERS_DIR: os.path.dirname(SERVER_IN_SANDBOX)},
        allow_cidrs=[test_host.cidr],
    )
    # Restricted sandboxes' proxies may reach the test host (a private address).
    egress = EgressProxies(EgressOptions(allow_private=True))
    manager = SandboxManager(db, backend, backend_name="local", isolation="bwrap", idle_pause_s=0, egress=egress)
    await manager.start()

    def register(server: grpc.aio.Server) -> list[str]:
        sandbox_service_pb2_grpc.add_SandboxServiceServicer_to_server(SandboxServicer(manager), server)
        return [pb.DESCRIPTOR.services_by_name["SandboxService"].full_name]

    running = await start_grpc_server("127.0.0.1:0", register, token=TEST_INTERNAL_TOKEN, callers=SANDBOX_CALLERS)
    address = f"127.0.0.1:{running.port}"
    channel = internal_channel(address)
    try:
        yield Service(stub=Stub(channel), address=address)
    finally:
        await channel.close()
        await running.stop(0.2)
        await manager.close()
        await db.dispose()


@pytest.fixture
async def second_client(service: Service) -> AsyncIterator[Stub]:
    """Another caller with its own channel."""
    channel = internal_channel(service.address)
    try:
        yield Stub(channel)
    finally:
        await channel.close()


@pytest.fixture(params=["sse", "json"])
async def http_server(request: pytest.FixtureRequest, test_host: TestHost) -> AsyncIterator[str]:
    """The test server over streamable HTTP on the test host, answering with
    SSE streams or with plain JSON bodies; yields its URL."""
    port = free_port_on(test_host)
    mode = ["json"] if request.param == "json" else []
    server = test_host.spawn([sys.executable, str(SERVER_SCRIPT), "http", str(port), *mode, "--host", "0.0.0.0"])
    await asyncio.to_thread(test_host.wait_listening, port, server)
    yield f"http://{test_host.address}:{port}/mcp"


# ---------------------------------------------------------------- helpers


def stdio_server(env_vars: tuple[str, ...] = (), **env: str) -> sandbox_pb2.McpTransport:
    return sandbox_pb2.McpTransport(
        stdio=sandbox_pb2.McpStdioTransport(
            command=HOST_PYTHON,
            args=[SERVER_IN_SANDBOX],
            env={"PYTHONPATH": SITE_IN_SANDBOX, **env},
            env_vars=list(env_vars),
        )
    )


async def create_sandbox(stub: Stub, sandbox_id: str, *, network: bool = False, env: dict[str, str] | None = None) -> None:
    access = common_pb2.NETWORK_ACCESS_ENABLED if network else common_pb2.NETWORK_ACCESS_DISABLED
    await stub.CreateSandbox(
        pb.CreateSandboxRequest(sandbox_id=sandbox_id, network=common_pb2.NetworkPolicy(access=access), env=env or {}),
        metadata=ORG_A,
    )


async def start(stub: Stub, sandbox_id: str, label: str, transport: sandbox_pb2.McpTransport) -> pb.StartMcpBrokerResponse:
    response: pb.StartMcpBrokerResponse = await stub.StartMcpBroker(
        pb.StartMcpBrokerRequest(sandbox_id=sandbox_id, label=label, transport=transport), metadata=ORG_A
    )
    return response


async def send(stub: Stub, sandbox_id: str, label: str, message: Json) -> Json | None:
    response = await stub.SendMcpMessage(
        pb.SendMcpMessageRequest(sandbox_id=sandbox_id, label=label, message_json=json.dumps(message)), metadata=ORG_A
    )
    return json.loads(response.message_json) if response.message_json else None


def initialize(msg_id: int | str, roots: bool = False) -> Json:
    capabilities: Json = {"roots": {"listChanged": False}} if roots else {}
    return {
        "jsonrpc": "2.0",
        "id": msg_id,
        "method": "initialize",
        "params": {"protocolVersion": PROTOCOL_VERSION, "capabilities": capabilities, "clientInfo": {"name": "berth-test", "version": "1"}},
    }


INITIALIZED: Json = {"jsonrpc": "2.0", "method": "notifications/initialized"}


def call(msg_id: int | str, tool: str, **arguments: Any) -> Json:
    return {"jsonrpc": "2.0", "id": msg_id, "method": "tools/call", "params": {"name": tool, "arguments": arguments}}


def result_of(response: Json | None) -> Any:
    assert response is not None and "result" in response, response
    return response["result"]["structuredContent"]["result"]


async def handshake(stub: Stub, sandbox_id: str, label: str, msg_id: int | str = 0, roots: bool = False) -> Json | None:
    response = await send(stub, sandbox_id, label, initialize(msg_id, roots))
    assert await send(stub, sandbox_id, label, INITIALIZED) is None
    return response


async def list_brokers(stub: Stub, sandbox_id: str) -> dict[str, sandbox_pb2.McpBroker]:
    listed = await stub.ListMcpBrokers(pb.ListMcpBrokersRequest(sandbox_id=sandbox_id), metadata=ORG_A)
    return {b.label: b for b in listed.brokers}


async def wait_until_dead(stub: Stub, sandbox_id: str, label: str) -> sandbox_pb2.McpBroker:
    async def dead() -> sandbox_pb2.McpBroker | None:
        broker = (await list_brokers(stub, sandbox_id))[label]
        return broker if broker.state == sandbox_pb2.MCP_BROKER_STATE_DEAD else None

    return await wait_until(dead, what=f"broker {label} died")


async def shell(stub: Stub, sandbox_id: str, command: str) -> tuple[int, str]:
    out, code = b"", None
    async for msg in stub.Exec(pb.ExecRequest(sandbox_id=sandbox_id, shell=command), metadata=ORG_A):
        if msg.HasField("chunk"):
            out += msg.chunk.data if msg.chunk.stream == common_pb2.OUTPUT_STREAM_STDOUT else b""
        else:
            code = msg.exit.exit_code
    assert code is not None
    return code, out.decode()


# The bracket keeps the grep and its shell from matching themselves.
COUNT_SERVERS = "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' '\\n' | grep -c '^/opt/berth-mcp/test_serve[r].py$'"


async def expect_error(code: grpc.StatusCode, reason: str | None, coro: Any) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await coro
    assert info.value.code() == code
    if reason is not None:
        assert reason_from_rpc_error(info.value)[0] == reason


# ---------------------------------------------------------------- stdio


async def test_a_later_start_with_another_configuration_reaches_the_first_server(service: Service) -> None:
    stub = service.stub
    await create_sandbox(stub, "sbx_reader")
    first = await start(stub, "sbx_reader", "reader", stdio_server(READER_VALUE="A"))
    second = await start(stub, "sbx_reader", "reader", stdio_server(READER_VALUE="B"))
    assert first.created and not second.created
    assert second.broker.pid == first.broker.pid
    assert second.broker.state == sandbox_pb2.MCP_BROKER_STATE_RUNNING
    await handshake(stub, "sbx_reader", "reader")
    assert result_of(await send(stub, "sbx_reader", "reader", call(1, "reader"))) == "A"


async def test_concurrent_calls_from_two_clients_with_the_same_ids_get_their_own_responses(service: Service, second_client: Stub) -> None:
    await create_sandbox(service.stub, "sbx_ids")
    await start(service.stub, "sbx_ids", "echo", stdio_server())
    await handshake(service.stub, "sbx_ids", "echo")

    async def one(stub: Stub, client: str, msg_id: int) -> None:
        # Later ids answer sooner, so responses come back out of order.
        response = await send(stub, "sbx_ids", "echo", call(msg_id, "echo", text=f"{client}-{msg_id}", delay_s=(10 - msg_id) * 0.02))
        assert response is not None and response["id"] == msg_id
        assert result_of(response) == f"{client}-{msg_id}"

    await asyncio.gather(*[one(stub, client, i) for client, stub in (("a", service.stub), ("b", second_client)) for i in range(10)])
    broker = (await list_brokers(service.stub, "sbx_ids"))["echo"]
    assert broker.in_flight == 0


async def test_concurrent_first_starts_create_exactly_one_server_process(service: Service) -> None:
    stub = service.stub
    await create_sandbox(stub, "sbx_race")
    starts = await asyncio.gather(*[start(stub, "sbx_race", "reader", stdio_server(READER_VALUE=str(i))) for i in range(10)])
    winners = [str(i) for i, s in enumerate(starts) if s.created]
    assert len(winners) == 1
    assert len({s.broker.pid for s in starts}) == 1
    assert await shell(stub, "sbx_race", COUNT_SERVERS) == (0, "1\n")
    await handshake(stub, "sbx_race", "reader")
    assert result_of(await send(stub, "sbx_race", "reader", call(1, "pid"))) == starts[0].broker.pid
    assert result_of(await send(stub, "sbx_race", "reader", call(2, "reader"))) == winners[0]


async def test_a_dead_server_fails_calls_cleanly_and_is_not_restarted_by_a_later_start(service: Service) -> None:
    stub = service.stub
    await create_sandbox(stub, "sbx_dead")
    started = await start(stub, "sbx_dead", "reader", stdio_server(READER_VALUE="A"))
    await handshake(stub, "sbx_dead", "reader")
    code, _ = await shell(stub, "sbx_dead", f"kill -9 {started.broker.pid}")
    assert code == 0
    dead = await wait_until_dead(stub, "sbx_dead", "reader")
    assert dead.exit.exit_code == -9

    await expect_error(grpc.StatusCode.FAILED_PRECONDITION, "MCP_SERVER_DEAD", send(stub, "sbx_dead", "reader", call(1, "reader")))
    again = await start(stub, "sbx_dead", "reader", stdio_server(READER_VALUE="B"))
    assert not again.created
    assert again.broker.state == sandbox_pb2.MCP_BROKER_STATE_DEAD
    assert again.broker.pid == started.broker.pid
    await expect_error(grpc.StatusCode.FAILED_PRECONDITION, "MCP_SERVER_DEAD", send(stub, "sbx_dead", "reader", call(2, "reader")))
    assert await shell(stub, "sbx_dead", COUNT_SERVERS) == (1, "0\n")


async def test_a_later_clients_initialize_is_answered_from_the_cache(service: Service, second_client: Stub) -> None:
    await create_sandbox(service.stub, "sbx_init")
    await start(service.stub, "sbx_init", "counter", stdio_server())
    first = await handshake(service.stub, "sbx_init", "counter", msg_id=1)
    later = await handshake(second_client, "sbx_init", "counter", msg_id="later")
    assert first is not None and later is not None
    assert first["id"] == 1 and later["id"] == "later"
    assert later["result"] == first["result"]
    assert result_of(await send(second_client, "sbx_init", "counter", call(2, "initialize_count"))) == 1


async def test_env_vars_are_inherited_from_the_sandbox_and_fixed_at_launch(service: Service) -> None:
    stub = service.stub
    await create_sandbox(stub, "sbx_env", env={"SANDBOX_TOKEN": "tok-1", "UNLISTED": "secret"})
    await start(stub, "sbx_env", "env", stdio_server(env_vars=("SANDBOX_TOKEN", "MISSING"), EXPLICIT="yes"))
    await handshake(stub, "sbx_env", "env")

    async def variable(name: str) -> str:
        return str(result_of(await send(stub, "sbx_env", "env", call(1, "env", name=name))))

    assert await variable("SANDBOX_TOKEN") == "tok-1"
    assert await variable("EXPLICIT") == "yes"
    assert await variable("UNLISTED") == "<unset>"
    assert await variable("MISSING") == "<unset>"
    await start(stub, "sbx_env", "env", stdio_server(SANDBOX_TOKEN="tok-2", EXPLICIT="no"))
    assert await variable("SANDBOX_TOKEN") == "tok-1"
    assert await variable("EXPLICIT") == "yes"


async def test_a_server_request_with_nobody_to_answer_it_fails_at_once_instead_of_hanging(service: Service) -> None:
    stub = service.stub
    await create_sandbox(stub, "sbx_sub")
    await start(stub, "sbx_sub", "chatty", stdio_server())
    await handshake(stub, "sbx_sub", "chatty", roots=True)
    assert result_of(await send(stub, "sbx_sub", "chatty", call(1, "ask_roots"))).startswith("error:")


async def test_list_reports_brokers_and_stop_kills_the_server(service: Service) -> None:
    stub = service.stub
    await create_sandbox(stub, "sbx_list")
    one = await start(stub, "sbx_list", "one", stdio_server())
    await start(stub, "sbx_list", "two", stdio_server())
    brokers = await list_brokers(stub, "sbx_list")
    assert sorted(brokers) == ["one", "two"]
    assert all(b.state == sandbox_pb2.MCP_BROKER_STATE_RUNNING and b.pid > 0 for b in brokers.values())
    assert brokers["one"].transport_type == sandbox_pb2.MCP_TRANSPORT_TYPE_STDIO

    stopped = await stub.StopMcpBroker(pb.StopMcpBrokerRequest(sandbox_id="sbx_list", label="one"), metadata=ORG_A)
    assert stopped.broker.state == sandbox_pb2.MCP_BROKER_STATE_DEAD
    code, _ = await shell(stub, "sbx_list", f"kill -0 {one.broker.pid}")
    assert code != 0
    assert await shell(stub, "sbx_list", COUNT_SERVERS) == (0, "1\n")
    assert (await list_brokers(stub, "sbx_list"))["two"].state == sandbox_pb2.MCP_BROKER_STATE_RUNNING
    await expect_error(grpc.StatusCode.FAILED_PRECONDITION, "MCP_SERVER_DEAD", send(stub, "sbx_list", "one", initialize(1)))

    await expect_error(grpc.StatusCode.NOT_FOUND, None, send(stub, "sbx_list", "nope", initialize(1)))
    await expect_error(
        grpc.StatusCode.NOT_FOUND, None, stub.StopMcpBroker(pb.StopMcpBrokerRequest(sandbox_id="sbx_list", label="nope"), metadata=ORG_A)
    )
    await expect_error(
        grpc.StatusCode.NOT_FOUND, None, stub.ListMcpBrokers(pb.ListMcpBrokersRequest(sandbox_id="sbx_list"), metadata=ORG_B)
    )


async def test_invalid_messages_and_configurations_are_invalid_arguments(service: Service) -> None:
    stub = service.stub
    await create_sandbox(stub, "sbx_bad")
    for label, transport in (
        ("bad label", stdio_server()),
        ("nocommand", sandbox_pb2.McpTransport(stdio=sandbox_pb2.McpStdioTransport(command="/no/such/server"))),
        ("ftp", sandbox_pb2.McpTransport(http=sandbox_pb2.McpHttpTransport(server_url="ftp://example.com/mcp"))),
    ):
        await expect_error(grpc.StatusCode.INVALID_ARGUMENT, None, start(stub, "sbx_bad", label, transport))
    assert await list_brokers(stub, "sbx_bad") == {}
    await start(stub, "sbx_bad", "ok", stdio_server())
    for text in ("not json", "[1, 2]"):
        await expect_error(
            grpc.StatusCode.INVALID_ARGUMENT,
            None,
            stub.SendMcpMessage(pb.SendMcpMessageRequest(sandbox_id="sbx_bad", label="ok", message_json=text), metadata=ORG_A),
        )


# ---------------------------------------------------------------- streamable HTTP


async def test_an_http_broker_round_trips_tool_calls_from_inside_the_sandbox(service: Service, http_server: str) -> None:
    stub = service.stub
    await create_sandbox(stub, "sbx_http", network=True)
    transport = sandbox_pb2.McpTransport(http=sandbox_pb2.McpHttpTransport(server_url=http_server, headers={"X-Berth-Test": "first"}))
    started = await start(stub, "sbx_http", "remote", transport)
    assert started.created and started.broker.transport_type == sandbox_pb2.MCP_TRANSPORT_TYPE_HTTP
    other = sandbox_pb2.McpTransport(http=sandbox_pb2.McpHttpTransport(server_url=http_server, headers={"X-Berth-Test": "second"}))
    assert not (await start(stub, "sbx_http", "remote", other)).created

    first = await handshake(stub, "sbx_http", "remote", msg_id=1)
    assert first is not None and first["result"]["protocolVersion"] == PROTOCOL_VERSION
    assert result_of(await send(stub, "sbx_http", "remote", call(2, "echo", text="over http"))) == "over http"
    assert result_of(await send(stub, "sbx_http", "remote", call(3, "header", name="x-berth-test"))) == "first"
    replies = await asyncio.gather(*[send(stub, "sbx_http", "remote", call(7, "echo", text=str(i))) for i in range(10)])
    assert [result_of(r) for r in replies] == [str(i) for i in range(10)]


async def test_closing_the_upstream_session_reinitializes_transparently_on_the_next_request(service: Service, http_server: str) -> None:
    stub = service.stub
    await create_sandbox(stub, "sbx_close", network=True)
    await start(stub, "sbx_close", "remote", sandbox_pb2.McpTransport(http=sandbox_pb2.McpHttpTransport(server_url=http_server)))
    await handshake(stub, "sbx_close", "remote")
    assert result_of(await send(stub, "sbx_close", "remote", call(1, "initialize_count"))) == 1

    closed = await stub.CloseMcpUpstream(pb.CloseMcpUpstreamRequest(sandbox_id="sbx_close", label="remote"), metadata=ORG_A)
    assert closed.closed
    # A peer's next request opens a fresh upstream session with the cached handshake.
    assert result_of(await send(stub, "sbx_close", "remote", call(2, "echo", text="still here"))) == "still here"
    assert result_of(await send(stub, "sbx_close", "remote", call(3, "initialize_count"))) == 2


async def test_an_unreachable_http_server_answers_with_a_jsonrpc_error(service: Service) -> None:
    stub = service.stub
    await create_sandbox(stub, "sbx_nohttp", network=True)
    url = f"http://127.0.0.1:{free_port()}/mcp"
    await start(stub, "sbx_nohttp", "gone", sandbox_pb2.McpTransport(http=sandbox_pb2.McpHttpTransport(server_url=url)))
    response = await send(stub, "sbx_nohttp", "gone", initialize(5))
    assert response is not None and response["id"] == 5
    assert response["error"]["code"] == -32000


def http_transport(url: str) -> sandbox_pb2.McpTransport:
    return sandbox_pb2.McpTransport(http=sandbox_pb2.McpHttpTransport(server_url=url))


async def test_a_sandbox_with_network_disabled_cannot_reach_an_http_server_its_enabled_peer_reaches(
    service: Service, test_host: TestHost
) -> None:
    stub = service.stub
    # The server starts before the sandboxes: once this test has created
    # sandboxes, nsenter into the test host's namespace fails (EINVAL).
    async with http_mcp_server(test_host) as url:
        await create_sandbox(stub, "sbx_http_on", network=True)
        await create_sandbox(stub, "sbx_http_off")
        await start(stub, "sbx_http_on", "remote", http_transport(url))
        await start(stub, "sbx_http_off", "remote", http_transport(url))
        reached = await handshake(stub, "sbx_http_on", "remote", msg_id=1)
        assert reached is not None and reached["result"]["protocolVersion"] == PROTOCOL_VERSION
        refused = await send(stub, "sbx_http_off", "remote", initialize(1))
        assert refused is not None and refused["id"] == 1
        assert refused["error"]["code"] == -32000
        assert "result" not in refused


async def test_an_http_servers_loopback_url_is_the_sandboxs_own_loopback_never_the_hosts(service: Service) -> None:
    stub = service.stub
    await create_sandbox(stub, "sbx_loop", network=True)
    async with http_mcp_server() as url:  # on the host's 127.0.0.1
        await start(stub, "sbx_loop", "host", http_transport(url))
        refused = await send(stub, "sbx_loop", "host", initialize(1))
        assert refused is not None and refused["error"]["code"] == -32000

        # A server the sandbox runs on the same port is what the same URL reaches.
        port = urllib.parse.urlsplit(url).port
        own = await stub.StartProcess(
            pb.StartProcessRequest(
                sandbox_id="sbx_loop",
                name="mcp",
                argv=[HOST_PYTHON, SERVER_IN_SANDBOX, "http", str(port)],
                env={"PYTHONPATH": SITE_IN_SANDBOX},
            ),
            metadata=ORG_A,
        )
        await start(stub, "sbx_loop", "own", http_transport(url))

        async def initialized() -> Json | None:
            response = await send(stub, "sbx_loop", "own", initialize(2))
            return response if response is not None and "result" in response else None

        await wait_until(initialized, 30, what="the sandbox's own HTTP MCP server to answer")
        assert await send(stub, "sbx_loop", "own", INITIALIZED) is None
        assert result_of(await send(stub, "sbx_loop", "own", call(3, "pid"))) == own.process.pid


async def test_a_restricted_sandbox_reaches_an_http_server_through_its_egress_proxy_only_when_allowed(
    service: Service, test_host: TestHost
) -> None:
    stub = service.stub
    async with http_mcp_server(test_host) as url:
        for sandbox_id, allowed in (("sbx_http_allowed", test_host.address), ("sbx_http_other", "example.com")):
            policy = common_pb2.NetworkPolicy(access=common_pb2.NETWORK_ACCESS_RESTRICTED, allowed_domains=[allowed])
            await stub.CreateSandbox(pb.CreateSandboxRequest(sandbox_id=sandbox_id, network=policy), metadata=ORG_A)
            await start(stub, sandbox_id, "remote", http_transport(url))
        reached = await handshake(stub, "sbx_http_allowed", "remote", msg_id=1)
        assert reached is not None and reached["result"]["protocolVersion"] == PROTOCOL_VERSION
        assert result_of(await send(stub, "sbx_http_allowed", "remote", call(2, "echo", text="via the proxy"))) == "via the proxy"
        refused = await send(stub, "sbx_http_other", "remote", initialize(1))
        assert refused is not None and "error" in refused and "result" not in refused


async def test_callers_initialized_before_a_service_restart_keep_calling_an_http_server(
    tmp_path: Path, bwrap_available: None, host_python_runs_mcp: None, test_host: TestHost
) -> None:
    async with http_mcp_server(test_host) as url:
        async with serve(tmp_path, test_host) as before:
            await create_sandbox(before.stub, "sbx_restart", network=True)
            await start(before.stub, "sbx_restart", "remote", http_transport(url))
            await handshake(before.stub, "sbx_restart", "remote", msg_id=1)
            assert result_of(await send(before.stub, "sbx_restart", "remote", call(2, "initialize_count"))) == 1
        async with serve(tmp_path, test_host) as after:
            # No initialize from the caller: the service replays the one it saw.
            assert result_of(await send(after.stub, "sbx_restart", "remote", call(3, "echo", text="again"))) == "again"
            assert result_of(await send(after.stub, "sbx_restart", "remote", call(4, "initialize_count"))) == 2
            later = await send(after.stub, "sbx_restart", "remote", initialize("later"))
            assert later is not None and later["id"] == "later" and "result" in later
            assert result_of(await send(after.stub, "sbx_restart", "remote", call(5, "initialize_count"))) == 2
            await after.stub.DestroySandbox(pb.DestroySandboxRequest(sandbox_id="sbx_restart"), metadata=ORG_A)


def test_extra_read_only_mounts_must_not_shadow_the_sandboxs_own_paths(tmp_path: Path) -> None:
    for target in ("relative/site", "/", "/workspace/site", "/run/berth", "/proc/x"):
        with pytest.raises(ValueError):
            LocalBackend(tmp_path / "data", "bwrap", extra_ro_mounts={SITE_PACKAGES: target})
    with pytest.raises(ValueError):
        LocalBackend(tmp_path / "data", "bwrap", extra_ro_mounts={tmp_path / "missing": "/opt/site"})
