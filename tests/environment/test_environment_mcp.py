"""The Environment service's MCP label registry and RPCs, against the real
Sandbox service (bubblewrap) running a real MCP server written with the
official ``mcp`` package, plus teardown order with the in-memory compute."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from environment_fakes import FakeCompute
from environment_helpers import (
    Cluster,
    EnvService,
    SandboxService,
    create_env,
    destroy_environment_sandboxes,
    get_env,
    md,
    reason_of,
    run_command,
    setup_config,
    wait_until,
)
from hosts_support import TestHost, make_test_host
from mcp_test_support import COUNT_SERVERS, SANDBOX_MOUNTS, http_mcp_server, require_host_python_mcp, stdio_transport
from grpc_support import internal_channel

from berth.environment.v1 import environment_pb2, environment_service_pb2 as pb
from berth.sandbox.v1 import sandbox_service_pb2_grpc
from services.core.settings import Settings

SESSION_A = "sess_a"
SESSION_B = "sess_b"
RUNNING = environment_pb2.MCP_SERVER_STATE_RUNNING
DEAD = environment_pb2.MCP_SERVER_STATE_DEAD
Json = dict[str, Any]


@pytest.fixture
def test_host() -> Iterator[TestHost]:
    """Where HTTP MCP servers run: sandboxes never reach the Berth host itself."""
    with make_test_host() as host:
        yield host


@pytest.fixture
async def mcp_sandbox(tmp_path: Path, bwrap_available: None, test_host: TestHost) -> AsyncIterator[SandboxService]:
    """The real Sandbox service with the test MCP server and the venv's
    site-packages mounted into every sandbox, whose network reaches the test
    host; its sandboxes are destroyed at teardown."""
    require_host_python_mcp()
    from services.sandbox.server import start_sandbox_service

    settings = Settings(
        data_dir=tmp_path / "sandbox",
        sandbox_idle_pause_s=0,
        sandbox_extra_ro_mounts=SANDBOX_MOUNTS,
        sandbox_allow_cidrs=[test_host.cidr],
    )
    handle = await start_sandbox_service(settings, address="127.0.0.1:0")
    channel = internal_channel(handle.address)
    service = SandboxService(handle, channel, sandbox_service_pb2_grpc.SandboxServiceStub(channel))
    try:
        yield service
    finally:
        await destroy_environment_sandboxes(service.stub)
        await channel.close()
        await handle.stop(0.2)


async def shared_environment(service: EnvService, *sessions: str, **config: Any) -> str:
    env = (await create_env(service.stub, config=setup_config("echo ran >> /workspace/setup.log", **config))).environment
    for session_id in sessions:
        await service.stub.AttachSession(pb.AttachSessionRequest(environment_id=env.id, session_id=session_id), metadata=md())
    return str(env.id)


async def start(
    service: EnvService, environment_id: str, session_id: str, label: str, transport: Json, org: str = "org_a"
) -> pb.StartMcpServerResponse:
    response: pb.StartMcpServerResponse = await service.stub.StartMcpServer(
        pb.StartMcpServerRequest(
            environment_id=environment_id, session_id=session_id, label=label, transport_json=json.dumps(transport)
        ),
        metadata=md(org),
    )
    return response


async def send(service: EnvService, environment_id: str, session_id: str, label: str, message: Json, org: str = "org_a") -> Json | None:
    response = await service.stub.SendMcpMessage(
        pb.SendMcpMessageRequest(environment_id=environment_id, session_id=session_id, label=label, message_json=json.dumps(message)),
        metadata=md(org),
    )
    return json.loads(response.response_json) if response.response_json else None


async def handshake(service: EnvService, environment_id: str, session_id: str, label: str) -> None:
    init = {
        "jsonrpc": "2.0",
        "id": 0,
        "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "berth-test", "version": "1"}},
    }
    response = await send(service, environment_id, session_id, label, init)
    assert response is not None and "result" in response, response
    assert await send(service, environment_id, session_id, label, {"jsonrpc": "2.0", "method": "notifications/initialized"}) is None


async def call(service: EnvService, environment_id: str, session_id: str, label: str, tool: str, **arguments: Any) -> Any:
    message = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": tool, "arguments": arguments}}
    response = await send(service, environment_id, session_id, label, message)
    assert response is not None and response["id"] == 7 and "result" in response, response
    return response["result"]["structuredContent"]["result"]


async def servers(service: EnvService, environment_id: str, org: str = "org_a") -> dict[str, environment_pb2.McpServer]:
    listed = await service.stub.ListMcpServers(pb.ListMcpServersRequest(environment_id=environment_id), metadata=md(org))
    return {s.label: s for s in listed.servers}


async def expect_error(code: grpc.StatusCode, coro: Any, reason: str | None = None) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await coro
    assert info.value.code() == code
    if reason is not None:
        assert reason_of(info.value) == reason


async def test_the_first_configuration_owns_a_label_and_a_later_session_reaches_its_server(
    cluster: Cluster, database_url: str, mcp_sandbox: SandboxService
) -> None:
    service = await cluster.start(database_url, sandbox_addr=mcp_sandbox.address)
    env_id = await shared_environment(service, SESSION_A, SESSION_B)

    first = await start(service, env_id, SESSION_A, "reader", stdio_transport(READER_VALUE="A"))
    assert first.created and first.server.owner_session_id == SESSION_A and first.server.state == RUNNING
    # The first MCP operation entered the init guard: setup ran, once.
    assert (await get_env(service.stub, env_id)).status == environment_pb2.ENVIRONMENT_STATUS_READY
    later = await start(service, env_id, SESSION_B, "reader", stdio_transport(READER_VALUE="B"))
    assert not later.created and later.server.owner_session_id == SESSION_A and later.server.pid == first.server.pid

    await handshake(service, env_id, SESSION_B, "reader")
    assert await call(service, env_id, SESSION_B, "reader", "reader") == "A"
    assert await run_command(service.stub, env_id, "cat /workspace/setup.log") == (0, b"ran\n")

    listed = await servers(service, env_id)
    reader = listed["reader"]
    assert (reader.origin, reader.transport_type, reader.owner_session_id, reader.state) == (
        "environment",
        environment_pb2.MCP_TRANSPORT_TYPE_STDIO,
        SESSION_A,
        RUNNING,
    )
    assert list(reader.session_ids) == [SESSION_A, SESSION_B]


async def test_concurrent_first_starts_register_the_session_whose_configuration_runs(
    cluster: Cluster, sqlite_url: str, mcp_sandbox: SandboxService
) -> None:
    service = await cluster.start(sqlite_url, sandbox_addr=mcp_sandbox.address)
    sessions = [f"sess_{i}" for i in range(8)]
    env_id = await shared_environment(service, *sessions)
    starts = await asyncio.gather(*(start(service, env_id, s, "reader", stdio_transport(READER_VALUE=s)) for s in sessions))
    winners = [s for s, response in zip(sessions, starts) if response.created]
    assert len(winners) == 1
    assert await run_command(service.stub, env_id, COUNT_SERVERS) == (0, b"1\n")
    await handshake(service, env_id, sessions[0], "reader")
    assert await call(service, env_id, sessions[0], "reader", "reader") == winners[0]
    assert (await servers(service, env_id))["reader"].owner_session_id == winners[0]


async def test_a_dead_server_is_listed_dead_and_not_restarted_by_a_later_configuration(
    cluster: Cluster, sqlite_url: str, mcp_sandbox: SandboxService
) -> None:
    service = await cluster.start(sqlite_url, sandbox_addr=mcp_sandbox.address)
    env_id = await shared_environment(service, SESSION_A, SESSION_B)
    started = await start(service, env_id, SESSION_A, "reader", stdio_transport(READER_VALUE="A"))
    assert (await run_command(service.stub, env_id, f"kill -9 {started.server.pid}"))[0] == 0

    async def dead() -> bool:
        return (await servers(service, env_id))["reader"].state == DEAD

    await wait_until(dead, what="the server is listed dead")
    again = await start(service, env_id, SESSION_B, "reader", stdio_transport(READER_VALUE="B"))
    assert not again.created and again.server.state == DEAD and again.server.owner_session_id == SESSION_A
    await expect_error(grpc.StatusCode.FAILED_PRECONDITION, handshake(service, env_id, SESSION_B, "reader"), "MCP_SERVER_DEAD")
    assert await run_command(service.stub, env_id, COUNT_SERVERS) == (1, b"0\n")


async def test_detaching_a_session_closes_its_http_upstreams_and_leaves_stdio_servers_running(
    cluster: Cluster, sqlite_url: str, mcp_sandbox: SandboxService, test_host: TestHost
) -> None:
    service = await cluster.start(sqlite_url, sandbox_addr=mcp_sandbox.address)
    env_id = await shared_environment(service, SESSION_A, SESSION_B, env={"SANDBOX_TOKEN": "tok-1"})
    async with http_mcp_server(test_host) as url:
        http = await start(service, env_id, SESSION_A, "remote", {"type": "http", "server_url": url, "headers": {"X-Berth-Test": "a"}})
        assert http.created and http.server.transport_type == environment_pb2.MCP_TRANSPORT_TYPE_HTTP
        stdio = await start(service, env_id, SESSION_A, "reader", stdio_transport(("SANDBOX_TOKEN",), READER_VALUE="A", SECRET="from-a"))
        await start(service, env_id, SESSION_B, "remote", {"type": "http", "server_url": url, "headers": {"X-Berth-Test": "b"}})
        await start(service, env_id, SESSION_B, "reader", stdio_transport(READER_VALUE="B"))
        await handshake(service, env_id, SESSION_B, "remote")
        assert await call(service, env_id, SESSION_B, "remote", "header", name="x-berth-test") == "a"
        assert await call(service, env_id, SESSION_B, "remote", "initialize_count") == 1

        await service.stub.DetachSession(pb.DetachSessionRequest(environment_id=env_id, session_id=SESSION_A), metadata=md())

        # The shared upstream session was ended; the peer's next request opens a fresh one.
        assert await call(service, env_id, SESSION_B, "remote", "initialize_count") == 2
        await handshake(service, env_id, SESSION_B, "reader")
        assert await call(service, env_id, SESSION_B, "reader", "reader") == "A"
        assert await call(service, env_id, SESSION_B, "reader", "env", name="SECRET") == "from-a"
        assert await call(service, env_id, SESSION_B, "reader", "env", name="SANDBOX_TOKEN") == "tok-1"
        listed = await servers(service, env_id)
        assert listed["reader"].pid == stdio.server.pid and listed["reader"].state == RUNNING
        assert list(listed["reader"].session_ids) == [SESSION_B] and listed["reader"].owner_session_id == SESSION_A


async def test_mcp_rpcs_of_another_organization_or_an_unattached_session_are_not_found(
    cluster: Cluster, sqlite_url: str, mcp_sandbox: SandboxService
) -> None:
    service = await cluster.start(sqlite_url, sandbox_addr=mcp_sandbox.address)
    env_id = await shared_environment(service, SESSION_A)
    transport = stdio_transport()
    await expect_error(grpc.StatusCode.NOT_FOUND, start(service, env_id, SESSION_A, "reader", transport, org="org_b"))
    await expect_error(grpc.StatusCode.NOT_FOUND, start(service, env_id, "sess_unattached", "reader", transport))
    await expect_error(grpc.StatusCode.NOT_FOUND, servers(service, env_id, org="org_b"))
    await start(service, env_id, SESSION_A, "reader", transport)
    ping = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
    await expect_error(grpc.StatusCode.NOT_FOUND, send(service, env_id, SESSION_A, "reader", ping, org="org_b"))
    await expect_error(grpc.StatusCode.NOT_FOUND, send(service, env_id, SESSION_A, "nope", ping))


async def test_invalid_labels_and_transports_are_invalid_arguments(env_service: EnvService) -> None:
    env_id = await shared_environment(env_service, SESSION_A)
    for label, transport in (
        ("bad label", stdio_transport()),
        ("ok", {"type": "stdio"}),
        ("ok", {"type": "http", "server_url": "ftp://example.com/mcp"}),
        ("ok", {"type": "carrier-pigeon"}),
    ):
        await expect_error(grpc.StatusCode.INVALID_ARGUMENT, start(env_service, env_id, SESSION_A, label, transport))
    await expect_error(
        grpc.StatusCode.INVALID_ARGUMENT,
        env_service.stub.StartMcpServer(
            pb.StartMcpServerRequest(environment_id=env_id, session_id=SESSION_A, label="ok", transport_json="{"), metadata=md()
        ),
    )
    # Nothing was validated into existence, and the environment never started.
    assert await servers(env_service, env_id) == {}
    assert (await get_env(env_service.stub, env_id)).status == environment_pb2.ENVIRONMENT_STATUS_PENDING


async def test_deleting_an_environment_stops_every_broker_before_destroying_its_sandbox(
    env_service: EnvService, fake: FakeCompute
) -> None:
    env_id = await shared_environment(env_service, SESSION_A)
    await start(env_service, env_id, SESSION_A, "reader", stdio_transport())
    await start(env_service, env_id, SESSION_A, "remote", {"type": "http", "server_url": "http://127.0.0.1:9/mcp", "authorization": "tok"})
    await env_service.stub.DetachSession(pb.DetachSessionRequest(environment_id=env_id, session_id=SESSION_A), metadata=md())
    sandbox_id = (await get_env(env_service.stub, env_id)).sandbox_id
    assert fake.mcp_calls == [("close", sandbox_id, "remote")]

    await env_service.stub.DeleteEnvironment(pb.DeleteEnvironmentRequest(environment_id=env_id), metadata=md())
    assert sorted(fake.mcp_calls[1:3]) == [("stop", sandbox_id, "reader"), ("stop", sandbox_id, "remote")]
    assert fake.mcp_calls[3:] == [("destroy", sandbox_id, "")]
    await expect_error(grpc.StatusCode.NOT_FOUND, servers(env_service, env_id))
