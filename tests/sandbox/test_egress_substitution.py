"""Secret substitution in the egress proxy, in process: a TLS server on
127.0.0.1 (certificate from a test CA) records every request it gets, and
a client talks to the proxy's unix socket as a sandbox's relay would. The
server's port is made a substitution port here (the real ones, 443 and
8443, need a privileged or fixed port), except where the port rule itself
is tested."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from cryptography import x509
from tls_support import FakeCA, fake_ca

from services.sandbox import egress
from services.sandbox.egress import EgressOptions, EgressPolicy, EgressProxy
from services.sandbox.egress_ca import EgressCA
from services.sandbox.egress_substitution import Interceptor, Substitution

pytestmark = pytest.mark.timeout(30)

SECRET, PLACEHOLDER = "the-real-secret-71c2", "berth-secret-00112233445566778899aabbccddeeff"


@pytest.fixture(autouse=True)
def _require_bwrap() -> None:
    """No sandbox here: the directory-wide bubblewrap check does not apply."""


@dataclass
class Recorder:
    port: int = 0
    requests: list[bytes] = field(default_factory=list)


async def _serve(recorder: Recorder, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Keep-alive HTTP/1.1: records each request's head and body, answers 200."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            body = b""
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    body = await reader.readexactly(int(line.split(b":", 1)[1]))
                if line.lower() == b"transfer-encoding: chunked":
                    while (size := int((await reader.readuntil(b"\r\n")).strip(), 16)) > 0:
                        body += await reader.readexactly(size)
                        await reader.readexactly(2)
                    await reader.readuntil(b"\r\n")
            recorder.requests.append(head + body)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
        pass
    finally:
        writer.close()


@dataclass
class Rig:
    ca: FakeCA
    egress_ca: EgressCA
    server: Recorder
    socket_path: str
    trust: Path


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    with fake_ca() as ca:
        recorder = Recorder()
        server = await asyncio.start_server(
            lambda r, w: _serve(recorder, r, w),
            "127.0.0.1",
            0,
            family=socket.AF_INET,
            ssl=ca.server_context(x509.DNSName("localhost"), tmp_path),
        )
        recorder.port = server.sockets[0].getsockname()[1]
        egress_ca = EgressCA(tmp_path / "egress-ca")
        (tmp_path / "run").mkdir()
        rig = Rig(ca, egress_ca, recorder, str(tmp_path / "run" / "egress.sock"), egress_ca.bundle_with(ca.bundle))
        try:
            yield rig
        finally:
            server.close()
            await server.wait_closed()


@contextlib.asynccontextmanager
async def proxy(rig: Rig, *, any_allowed_host: bool = False) -> AsyncIterator[EgressProxy]:
    served = EgressProxy(
        "sbx_test",
        rig.socket_path,
        EgressPolicy(["localhost"]),
        EgressOptions(allow_private=True),
        substitutions=[Substitution(PLACEHOLDER, SECRET, any_allowed_host, frozenset({"localhost"}), "vcred_test")],
        interceptor=Interceptor(rig.egress_ca, rig.ca.bundle),
    )
    await served.start()
    try:
        yield served
    finally:
        await served.close()


async def exchange(rig: Rig, requests: list[bytes], *, alpn: list[str] | None = None, responses: int = 1) -> tuple[str | None, bytes]:
    """Sends ``requests`` on one TLS connection through the proxy, which
    is trusted as the sandbox trusts it; (ALPN chosen, what came back)."""
    reader, writer = await asyncio.open_unix_connection(rig.socket_path)
    try:
        target = f"localhost:{rig.server.port}"
        writer.write(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        context = ssl.create_default_context(cafile=str(rig.trust))
        if alpn:
            context.set_alpn_protocols(alpn)
        await writer.start_tls(context, server_hostname="localhost")
        chosen = writer.get_extra_info("ssl_object").selected_alpn_protocol()
        for request in requests:
            writer.write(request)
        await writer.drain()
        received = b""
        while received.count(b"HTTP/1.1 200") < responses:
            data = await asyncio.wait_for(reader.read(65536), 10)
            if not data:
                break
            received += data
        return chosen, received
    finally:
        writer.close()


def _substitution_port(monkeypatch: pytest.MonkeyPatch, rig: Rig) -> None:
    monkeypatch.setattr(egress, "SUBSTITUTION_PORTS", frozenset({rig.server.port}))


async def test_the_placeholder_in_the_request_line_and_headers_becomes_the_secret_and_the_body_stays_as_sent(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    _substitution_port(monkeypatch, rig)
    body = f"token={PLACEHOLDER}".encode()
    request = (
        f"POST /v1/x?key={PLACEHOLDER} HTTP/1.1\r\nHost: other.example\r\nAuthorization: Bearer {PLACEHOLDER}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    async with proxy(rig):
        _, received = await exchange(rig, [request])
    assert received.endswith(b"ok")
    [seen] = rig.server.requests
    head, _, sent_body = seen.partition(b"\r\n\r\n")
    assert head.startswith(f"POST /v1/x?key={SECRET} HTTP/1.1\r\n".encode())
    assert f"Authorization: Bearer {SECRET}".encode() in head
    # Host is the CONNECT target: no other virtual host behind the address gets the secret.
    assert f"Host: localhost:{rig.server.port}".encode() in head and b"other.example" not in head
    assert sent_body == body


async def test_every_request_of_a_kept_alive_connection_is_substituted_and_chunked_bodies_pass_intact(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    _substitution_port(monkeypatch, rig)
    chunked = f"POST /c HTTP/1.1\r\nHost: localhost\r\nX-Key: {PLACEHOLDER}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
    chunked += b"5\r\nhello\r\n0\r\n\r\n"
    second = f"GET /d HTTP/1.1\r\nHost: localhost\r\nX-Key: {PLACEHOLDER}\r\n\r\n".encode()
    async with proxy(rig):
        await exchange(rig, [chunked, second], responses=2)
    assert len(rig.server.requests) == 2
    assert all(f"X-Key: {SECRET}".encode() in r and PLACEHOLDER.encode() not in r for r in rig.server.requests)
    assert rig.server.requests[0].endswith(b"hello")


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST /x HTTP/1.1\r\nHost: localhost\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
        f"GET https://other.example/?k={PLACEHOLDER} HTTP/1.1\r\nHost: other.example\r\n\r\n".encode(),
        b"POST /x HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
        b"POST /x HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
    ],
    ids=["length-and-chunked", "absolute-form", "other-encoding", "two-lengths"],
)
async def test_a_request_framed_ambiguously_or_aimed_elsewhere_is_not_forwarded(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, request_bytes: bytes
) -> None:
    _substitution_port(monkeypatch, rig)
    async with proxy(rig):
        _, received = await exchange(rig, [request_bytes])
    assert received == b"" and rig.server.requests == []


async def test_a_client_offering_only_h2_is_not_given_h2(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    _substitution_port(monkeypatch, rig)
    async with proxy(rig):
        chosen, _ = await exchange(rig, [b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n"], alpn=["h2"])
        offered, _ = await exchange(rig, [b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n"], alpn=["h2", "http/1.1"])
    assert chosen is None and offered == "http/1.1"


async def test_a_connect_to_a_port_other_than_443_or_8443_stays_an_end_to_end_tunnel(rig: Rig) -> None:
    # The sandbox's trust store without the egress CA: only the real server's certificate verifies.
    rig.trust = rig.ca.bundle
    async with proxy(rig, any_allowed_host=True):
        _, received = await exchange(rig, [f"GET / HTTP/1.1\r\nHost: localhost\r\nX-Key: {PLACEHOLDER}\r\n\r\n".encode()])
    assert received.endswith(b"ok")
    assert f"X-Key: {PLACEHOLDER}".encode() in rig.server.requests[0]


async def test_a_host_outside_the_credentials_allowed_hosts_gets_the_placeholder_through_a_tunnel(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    _substitution_port(monkeypatch, rig)
    rig.trust = rig.ca.bundle
    served = EgressProxy(
        "sbx_test",
        rig.socket_path,
        EgressPolicy(["localhost"]),
        EgressOptions(allow_private=True),
        substitutions=[Substitution(PLACEHOLDER, SECRET, False, frozenset({"api.example.com"}), "vcred_test")],
        interceptor=Interceptor(rig.egress_ca, rig.ca.bundle),
    )
    await served.start()
    try:
        await exchange(rig, [f"GET / HTTP/1.1\r\nHost: localhost\r\nX-Key: {PLACEHOLDER}\r\n\r\n".encode()])
    finally:
        await served.close()
    assert f"X-Key: {PLACEHOLDER}".encode() in rig.server.requests[0]


async def test_a_kept_alive_connection_takes_a_rotated_secret_and_a_removal_at_its_next_request(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    _substitution_port(monkeypatch, rig)
    request = f"GET /r HTTP/1.1\r\nHost: localhost\r\nX-Key: {PLACEHOLDER}\r\n\r\n".encode()
    rotated = Substitution(PLACEHOLDER, "the-rotated-secret-5d", False, frozenset({"localhost"}), "vcred_test")
    async with proxy(rig) as served:
        reader, writer = await asyncio.open_unix_connection(rig.socket_path)
        try:
            target = f"localhost:{rig.server.port}"
            writer.write(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
            await writer.start_tls(ssl.create_default_context(cafile=str(rig.trust)), server_hostname="localhost")
            for replacement in ([rotated], [], None):
                writer.write(request)
                await writer.drain()
                response = await asyncio.wait_for(reader.readuntil(b"\r\n\r\nok"), 10)
                assert response.startswith(b"HTTP/1.1 200")
                if replacement is not None:
                    served.replace_substitutions(replacement)
        finally:
            writer.close()
    keys = [line for r in rig.server.requests for line in r.split(b"\r\n") if line.startswith(b"X-Key:")]
    assert keys == [f"X-Key: {v}".encode() for v in (SECRET, "the-rotated-secret-5d", PLACEHOLDER)]
