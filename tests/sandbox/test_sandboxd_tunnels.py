"""sandboxd's ``net.connect``: a TCP stream opened from inside the sandbox
and carried over a daemon connection of its own, the only way the Sandbox
service's MCP HTTP client reaches a server."""

from __future__ import annotations

import asyncio

import pytest
from sandbox_support import SandboxFactory, host_listener
from waiting import wait_until

from services.sandbox.daemon_client import DaemonError

pytestmark = pytest.mark.timeout(60)

# Echoes one connection's bytes upper-cased on 127.0.0.1:argv[1] (the
# sandbox's own loopback), once.
_UPPER_SERVER = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen(1)
c, _ = s.accept()
data = b""
while True:
    chunk = c.recv(4096)
    if not chunk:
        break
    data += chunk
c.sendall(data.upper())
c.close()
"""
_PORT = 47001


async def test_a_tunnel_carries_a_stream_to_a_server_on_the_sandboxs_own_loopback(make_sandbox: SandboxFactory) -> None:
    sandbox = await make_sandbox("tunnel")
    await sandbox.client.start_process(name="upper", argv=["python3", "-c", _UPPER_SERVER, str(_PORT)])

    async def opened() -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        try:
            return await sandbox.client.open_tunnel("127.0.0.1", _PORT)
        except DaemonError as exc:
            assert exc.reason == "connect_failed"
            return None

    reader, writer = await wait_until(opened, 20, what="the sandbox's server to listen")
    writer.write(b"through the tunnel")
    writer.write_eof()
    try:
        assert await asyncio.wait_for(reader.read(), 10) == b"THROUGH THE TUNNEL"
    finally:
        writer.close()


async def test_a_tunnel_never_reaches_the_hosts_loopback(make_sandbox: SandboxFactory) -> None:
    sandbox = await make_sandbox("tunnel-host", network="enabled")
    async with host_listener("127.0.0.1", b"host") as (port, accepted):
        with pytest.raises(DaemonError) as refused:
            await sandbox.client.open_tunnel("127.0.0.1", port)
    assert refused.value.code == "failed_precondition" and refused.value.reason == "connect_failed"
    assert accepted == []


async def test_a_tunnel_to_a_bad_port_is_an_invalid_argument(make_sandbox: SandboxFactory) -> None:
    sandbox = await make_sandbox("tunnel-bad")
    for port in (0, 70000):
        with pytest.raises(DaemonError) as bad:
            await sandbox.client.open_tunnel("127.0.0.1", port)
        assert bad.value.code == "invalid_argument"
