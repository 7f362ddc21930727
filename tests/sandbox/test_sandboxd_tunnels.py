"""sandboxd's ``net.connect``: a TCP stream opened from inside the sandbox
and carried over a daemon connection of its own, the only way the Sandbox
service's MCP HTTP client (``services/sandbox/mcp_http.py``) reaches a
server."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import httpx2
import pytest
from sandbox_support import SandboxFactory, host_listener
from waiting import wait_until

from services.sandbox.daemon_client import DaemonError
from services.sandbox.mcp_http import sandbox_http_client

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


# Serves HTTPS on 127.0.0.1:argv[1] with the certificate and key at
# argv[2], argv[3], answering every GET with "over tls".
_TLS_SERVER = """
import http.server, ssl, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"over tls"
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain(sys.argv[2], sys.argv[3])
server.socket = context.wrap_socket(server.socket, server_side=True)
server.serve_forever()
"""


async def test_the_sandboxs_http_client_speaks_tls_over_a_tunnel_and_trusts_only_the_given_bundle(
    make_sandbox: SandboxFactory, tmp_path: Path
) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    sandbox = await make_sandbox("tunnel-tls")
    await sandbox.client.write_file("/workspace/cert.pem", cert.read_bytes())
    await sandbox.client.write_file("/workspace/key.pem", key.read_bytes())
    await sandbox.client.start_process(
        name="tls", argv=["python3", "-c", _TLS_SERVER, str(_PORT), "/workspace/cert.pem", "/workspace/key.pem"]
    )
    url = f"https://localhost:{_PORT}/"

    async with sandbox_http_client(sandbox.client, headers={}, proxy=None, ca_bundle=cert) as http:

        async def answered() -> httpx2.Response | None:
            try:
                return await http.get(url)
            except httpx2.ConnectError as exc:
                if "ssl" in type(exc.__cause__).__name__.lower() or "certificate" in str(exc).lower():
                    raise
                return None  # not listening yet

        response = await wait_until(answered, 20, what="the sandbox's TLS server to answer")
    assert response.status_code == 200 and response.text == "over tls"

    async with sandbox_http_client(sandbox.client, headers={}, proxy=None) as untrusting:
        with pytest.raises(httpx2.ConnectError):
            await untrusting.get(url)
