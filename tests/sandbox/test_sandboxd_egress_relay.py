"""sandboxd's ``egress.relay``: a loopback listener in the sandbox whose
connections go to a unix socket the host serves in the mounted run dir."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from sandbox_support import SandboxFactory

from services.sandbox.daemon_client import DaemonError

pytestmark = pytest.mark.timeout(60)

# Sends argv[2] to 127.0.0.1:argv[1], half-closes, and prints what comes
# back until EOF.
_ROUND_TRIP = """
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10)
s.sendall(sys.argv[2].encode())
s.shutdown(socket.SHUT_WR)
data = b""
while True:
    chunk = s.recv(4096)
    if not chunk:
        break
    data += chunk
print(repr(data))
"""


async def test_the_relay_carries_a_connection_to_the_unix_socket_and_is_idempotent(make_sandbox: SandboxFactory) -> None:
    sandbox = await make_sandbox("relay")
    mounted = Path(sandbox.handle.socket_path).parent

    async def upper(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write((await reader.read()).upper())
        await writer.drain()
        writer.close()

    server = await asyncio.start_unix_server(upper, str(mounted / "upper.sock"))
    # The sandbox's unprivileged user connects to it, as to the egress proxy's socket.
    (mounted / "upper.sock").chmod(0o666)
    try:
        port = await sandbox.client.start_egress_relay(0, "/run/berth/upper.sock")
        again = await sandbox.client.start_egress_relay(port, "/run/berth/upper.sock")
        result = await sandbox.client.run(argv=["python3", "-c", _ROUND_TRIP, str(port), "half-closed request"], timeout_s=30)
        with pytest.raises(DaemonError) as other:
            await sandbox.client.start_egress_relay(0, "/run/berth/other.sock")
    finally:
        server.close()
        await server.wait_closed()

    assert port > 0 and again == port
    assert (result.exit_code, result.stdout) == (0, b"b'HALF-CLOSED REQUEST'\n"), result.stderr
    assert other.value.code == "failed_precondition"


# Connects to 127.0.0.1:argv[1] and waits (bounded) for the other side to
# close: prints "closed" on EOF or reset; a timeout fails.
_AWAIT_CLOSE = """
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10)
try:
    data = s.recv(4096)
except ConnectionResetError:
    data = b""
print("closed" if data == b"" else repr(data))
"""


async def test_a_relay_connection_closes_at_once_while_nothing_serves_the_socket(make_sandbox: SandboxFactory) -> None:
    sandbox = await make_sandbox("relay-missing")
    port = await sandbox.client.start_egress_relay(0, "/run/berth/missing.sock")

    result = await sandbox.client.run(argv=["python3", "-c", _AWAIT_CLOSE, str(port)], timeout_s=30)

    assert (result.exit_code, result.stdout) == (0, b"closed\n"), result.stderr
