"""Helpers for egress proxy tests, imported explicitly (``from egress_helpers
import ...``): target servers on the host's loopback, the scripts a sandbox
runs against its proxy, and a guard that keeps every name lookup local."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

__all__ = ["Target", "http_target", "echo_target", "local_names_only", "FETCH", "CONNECT", "DIRECT"]

# Names a test may resolve: /etc/hosts answers them. A lookup of anything
# else fails the test instead of asking the host's DNS server.
_LOCAL_NAMES = {"localhost"}


def _is_ip(host: object) -> bool:
    try:
        ipaddress.ip_address(str(host))
    except ValueError:
        return False
    return True


@contextlib.contextmanager
def _guarded_getaddrinfo() -> Iterator[list[str]]:
    refused: list[str] = []
    real = socket.getaddrinfo

    def guarded(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host is not None and not _is_ip(host) and str(host).lower() not in _LOCAL_NAMES:
            refused.append(str(host))
            raise socket.gaierror(socket.EAI_NONAME, f"test guard: no lookup of {host!r}")
        return real(host, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket, "getaddrinfo", guarded)
        yield refused


@pytest.fixture(scope="module")
def local_names_only() -> Iterator[list[str]]:
    """No name other than ``localhost`` is resolved in this process (the
    egress proxy runs in it); yields the names that were refused."""
    with _guarded_getaddrinfo() as refused:
        yield refused


@dataclass
class Target:
    """A server on 127.0.0.1 and what reached it."""

    port: int
    requests: list[bytes] = field(default_factory=list)
    connections: int = 0


async def _serve_http(target: Target, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    target.connections += 1
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()
        return
    target.requests.append(head)
    body = b"hello from the host: " + head.split(b"\r\n", 1)[0]
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    writer.close()


async def _serve_echo(target: Target, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    target.connections += 1
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    writer.close()


@contextlib.asynccontextmanager
async def _serve(handler: Any) -> AsyncIterator[Target]:
    target = Target(port=0)
    server = await asyncio.start_server(lambda r, w: handler(target, r, w), "127.0.0.1", 0, family=socket.AF_INET)
    target.port = server.sockets[0].getsockname()[1]
    try:
        yield target
    finally:
        server.close()
        await server.wait_closed()


def http_target() -> contextlib.AbstractAsyncContextManager[Target]:
    """An HTTP server answering 200 with its request line in the body."""
    return _serve(_serve_http)


def echo_target() -> contextlib.AbstractAsyncContextManager[Target]:
    """A TCP server echoing every byte."""
    return _serve(_serve_echo)


# Fetches argv[1] with urllib through the proxy of the environment and
# prints the status (and the body on success). NO_PROXY names localhost, and
# the test servers are the host's localhost, so it is dropped here.
FETCH = r"""
import os, sys, urllib.error, urllib.request
for name in ("NO_PROXY", "no_proxy"):
    os.environ.pop(name, None)
try:
    with urllib.request.urlopen(sys.argv[1], timeout=20) as response:
        print(response.status, response.read().decode())
except urllib.error.HTTPError as exc:
    print(exc.code)
"""

# Opens a CONNECT tunnel to argv[1] through $HTTPS_PROXY, prints the status
# and, once tunnelled, what comes back from a line sent through it.
CONNECT = r"""
import os, socket, sys, urllib.parse
proxy = urllib.parse.urlsplit(os.environ["HTTPS_PROXY"])
s = socket.create_connection((proxy.hostname, proxy.port), timeout=20)
s.sendall(b"CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (sys.argv[1].encode(), sys.argv[1].encode()))
head = b""
while b"\r\n\r\n" not in head:
    chunk = s.recv(4096)
    if not chunk:
        break
    head += chunk
status = head.split(b" ")[1].decode() if b" " in head else "none"
print(status)
if status == "200":
    s.sendall(b"ping through the tunnel\n")
    echoed = head.split(b"\r\n\r\n", 1)[1]
    while not echoed.endswith(b"\n"):
        chunk = s.recv(4096)
        if not chunk:
            break
        echoed += chunk
    print(echoed.decode().strip())
"""

# Connects straight to 127.0.0.1:argv[1], bypassing every proxy; exit 7
# when that fails.
DIRECT = r"""
import socket, sys
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5).close()
except OSError as exc:
    print("blocked: %r" % exc)
    sys.exit(7)
print("connected")
"""
