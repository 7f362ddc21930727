"""An environment with ``restricted`` network, end to end: the Environment
service creates its sandbox on the real Sandbox service (bubblewrap), whose
egress proxy lets commands reach allowed hosts only."""

from __future__ import annotations

import asyncio
import shlex
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from environment_helpers import Cluster, SandboxService, create_env, destroy_environment_sandboxes, run_command
from grpc_support import internal_channel

from berth.common.v1 import common_pb2
from berth.environment.v1 import environment_pb2
from berth.sandbox.v1 import sandbox_service_pb2_grpc
from services.core.settings import Settings

pytestmark = pytest.mark.timeout(120)

# Prints the status of fetching argv[1] through the environment's proxy.
# NO_PROXY names localhost, which here is the host's test server.
FETCH = r"""
import os, sys, urllib.error, urllib.request
for name in ("NO_PROXY", "no_proxy"):
    os.environ.pop(name, None)
try:
    with urllib.request.urlopen(sys.argv[1], timeout=20) as response:
        print(response.status)
except urllib.error.HTTPError as exc:
    print(exc.code)
"""


@pytest.fixture
def local_names_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Only ``localhost`` and IP literals are resolved in this process (the
    egress proxy runs in it), never through the host's DNS server."""
    refused: list[str] = []
    real = socket.getaddrinfo

    def guarded(host: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            socket.inet_pton(socket.AF_INET6 if ":" in str(host) else socket.AF_INET, str(host))
        except OSError:
            if host is not None and str(host).lower() != "localhost":
                refused.append(str(host))
                raise socket.gaierror(socket.EAI_NONAME, f"test guard: no lookup of {host!r}") from None
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", guarded)
    yield refused
    assert refused == []


@pytest.fixture
async def lenient_sandbox_service(tmp_path: Path, local_names_only: list[str], bwrap_available: None) -> AsyncIterator[SandboxService]:
    """The real Sandbox service whose egress proxies may reach the host's loopback."""
    from services.sandbox.server import start_sandbox_service

    settings = Settings(data_dir=tmp_path / "sandbox", sandbox_idle_pause_s=0, sandbox_egress_allow_private=True)
    handle = await start_sandbox_service(settings, address="127.0.0.1:0")
    channel = internal_channel(handle.address)
    service = SandboxService(handle, channel, sandbox_service_pb2_grpc.SandboxServiceStub(channel))
    try:
        yield service
    finally:
        await destroy_environment_sandboxes(service.stub)
        await channel.close()
        await handle.stop(0.2)


async def test_an_environment_with_restricted_network_reaches_only_its_allowed_domains(
    cluster: Cluster, sqlite_url: str, lenient_sandbox_service: SandboxService
) -> None:
    requests: list[bytes] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0, family=socket.AF_INET)
    port = server.sockets[0].getsockname()[1]
    try:
        service = await cluster.start(sqlite_url, sandbox_addr=lenient_sandbox_service.address)
        network = common_pb2.NetworkPolicy(access=common_pb2.NETWORK_ACCESS_RESTRICTED, allowed_domains=["localhost"])
        env = (await create_env(service.stub, config=environment_pb2.EnvironmentConfig(network=network))).environment

        allowed = await run_command(service.stub, env.id, f"python3 -c {shlex.quote(FETCH)} http://localhost:{port}/allowed")
        denied = await run_command(service.stub, env.id, f"python3 -c {shlex.quote(FETCH)} http://127.0.0.1:{port}/denied")
    finally:
        server.close()
        await server.wait_closed()

    assert allowed == (0, b"200\n")
    assert denied == (0, b"403\n")
    assert [r.split(b"\r\n", 1)[0] for r in requests] == [b"GET /allowed HTTP/1.1"]
