"""Secret substitution in the egress proxy of a ``restricted`` sandbox.

An ``environment_variable`` vault credential reaches its sandbox as a
placeholder (``berth-secret-`` and 32 random hex digits, new for each
sandbox and credential) in the variable it names. A ``CONNECT`` to a host
where one of the sandbox's credentials applies (one of its
``allowed_hosts``, or any host the policy allows for ``unrestricted``
networking), on port 443 or 8443, is not tunnelled: the proxy opens TLS to
the real host first (verified against the sandboxes' configured CA bundle,
HTTP/1.1 by ALPN, through the upstream proxy when one is configured),
answers ``200``, and terminates the sandbox's TLS with a certificate for
that host from the egress CA (``egress_ca.py``, which sandboxes trust).
Then, request by request, every occurrence of the placeholders that apply
to that host in the request line and the header values is replaced with
the secret, and ``Host`` is set to the CONNECT target (so no other virtual
host behind the same address receives it). Bodies are forwarded untouched:
a body is data the sandbox chose, and rewriting it would change its length
and framing. Responses are copied back unchanged.

Framing is checked strictly so that what the proxy takes for a head is
what the server takes for one: origin-form targets only, HTTP/1.x, one
``Content-Length`` or ``Transfer-Encoding: chunked`` (never both); anything
else closes the connection. An upgraded connection (WebSocket) is copied
raw after its first head. Every other CONNECT stays an end-to-end tunnel,
so a placeholder sent anywhere else leaves as the placeholder.

What it cannot prevent: a host in ``allowed_hosts`` that echoes requests
(its headers, its URL) back shows the sandbox the secret. Choose them as
you would choose who may hold the secret.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from services.sandbox.egress_ca import EgressCA

__all__ = ["Substitution", "Substitutions", "SUBSTITUTION_PORTS", "new_placeholder", "Interceptor", "InterceptFailed"]

SUBSTITUTION_PORTS = frozenset({443, 8443})
_PLACEHOLDER_PREFIX = "berth-secret-"
_HEAD_TIMEOUT_S = 30.0
_TLS_TIMEOUT_S = 15.0
_COPY_BYTES = 64 * 1024
_CHUNK_SIZE = re.compile(rb"^([0-9a-fA-F]{1,16})(;[^\r\n]*)?\r\n$")
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")


def new_placeholder() -> str:
    return _PLACEHOLDER_PREFIX + secrets.token_hex(16)


@dataclass(frozen=True)
class Substitution:
    """One credential of one sandbox. ``allowed_hosts`` are canonical
    (``egress.parse_host``): lowercase names and ``ipaddress`` objects."""

    placeholder: str
    value: str = field(repr=False)
    any_allowed_host: bool
    allowed_hosts: frozenset[object]
    credential_id: str = ""

    def applies_to(self, host: object) -> bool:
        return self.any_allowed_host or host in self.allowed_hosts


# What applies to a connection, asked again for each request, so that a
# rotated or deleted credential applies on a kept-alive connection too.
Substitutions = Sequence[Substitution] | Callable[[], Sequence[Substitution]]


def _current(substitutions: Substitutions) -> Sequence[Substitution]:
    return substitutions() if callable(substitutions) else substitutions


class InterceptFailed(Exception):
    """The real host could not be reached over TLS (nothing was answered yet)."""


class _Framing(Exception):
    """A request the proxy will not frame; the connection is closed."""


@dataclass(frozen=True)
class _Head:
    data: bytes
    body: str  # "none", "length", "chunked" or "raw" (an upgrade)
    length: int = 0


def _rewrite_head(head: bytes, authority: str, substitutions: Sequence[Substitution]) -> _Head:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1.") or not _TOKEN.match(parts[0]):
        raise _Framing("malformed request line")
    method, target, version = parts
    if not (target.startswith("/") or (target == "*" and method == "OPTIONS")):
        raise _Framing("only origin-form request targets")
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not _TOKEN.match(name):
            raise _Framing("malformed header")
        headers.append((name, value.strip()))
    lowered = [(n.lower(), v) for n, v in headers]
    lengths = {v for n, v in lowered if n == "content-length"}
    encodings = [v for n, v in lowered if n == "transfer-encoding"]
    connection = {t.strip().lower() for n, v in lowered if n == "connection" for t in v.split(",")}
    if encodings and lengths:
        raise _Framing("both Content-Length and Transfer-Encoding")
    body, length = "none", 0
    if encodings:
        if [e.strip().lower() for e in ",".join(encodings).split(",")] != ["chunked"]:
            raise _Framing("only Transfer-Encoding: chunked")
        body = "chunked"
    elif lengths:
        if len(lengths) != 1 or not next(iter(lengths)).isdigit():
            raise _Framing("invalid Content-Length")
        body, length = "length", int(next(iter(lengths)))
    if "upgrade" in connection and any(n == "upgrade" for n, _ in lowered):
        body = "raw"
    out = [f"{method} {target} {version}", f"Host: {authority}"]
    out += [f"{n}: {v}" for n, v in headers if n.lower() != "host"]
    data = ("\r\n".join(out) + "\r\n\r\n").encode("latin-1")
    for substitution in substitutions:
        data = data.replace(substitution.placeholder.encode(), substitution.value.encode())
    return _Head(data, body, length)


async def _copy_exactly(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, count: int) -> None:
    while count > 0:
        data = await reader.readexactly(min(count, _COPY_BYTES))
        writer.write(data)
        await writer.drain()
        count -= len(data)


async def _copy_chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        line = await reader.readuntil(b"\r\n")
        match = _CHUNK_SIZE.match(line)
        if match is None:
            raise _Framing("malformed chunk size")
        size = int(match.group(1), 16)
        writer.write(line)
        if size == 0:
            while (trailer := await reader.readuntil(b"\r\n")) != b"\r\n":
                writer.write(trailer)
            writer.write(b"\r\n")
            await writer.drain()
            return
        await _copy_exactly(reader, writer, size)
        if await reader.readexactly(2) != b"\r\n":
            raise _Framing("malformed chunk")
        writer.write(b"\r\n")


async def _copy_raw(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(_COPY_BYTES):
        writer.write(data)
        await writer.drain()


class Interceptor:
    """Substitutes secrets on the CONNECT tunnels of one egress proxy."""

    def __init__(self, ca: EgressCA, upstream_ca_bundle: Path | None) -> None:
        self._ca = ca
        context = ssl.create_default_context(cafile=str(upstream_ca_bundle) if upstream_ca_bundle else None)
        context.set_alpn_protocols(["http/1.1"])
        self._upstream_context = context

    async def run(
        self,
        host: str,
        port: int,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        substitutions: Substitutions,
    ) -> None:
        """``upstream`` is a TCP connection to ``host:port`` (or a tunnel to
        it through the upstream proxy); ``client`` has sent its CONNECT and
        waits for the answer. A callable ``substitutions`` is asked for the
        current ones before each request head. Raises InterceptFailed
        before answering."""
        client_reader, client_writer = client
        upstream_reader, upstream_writer = upstream
        try:
            await asyncio.wait_for(
                upstream_writer.start_tls(self._upstream_context, server_hostname=host), _TLS_TIMEOUT_S
            )
        except (OSError, ssl.SSLError, TimeoutError, ConnectionError) as exc:
            raise InterceptFailed(f"tls_to_upstream_failed: {exc!r}") from None
        server_context = await asyncio.to_thread(self._ca.server_context, host)
        # The client's ClientHello must reach the TLS layer, not the plain
        # stream's buffer: nothing is read until start_tls takes over.
        client_writer.transport.pause_reading()  # type: ignore[attr-defined]
        client_writer.write(b"HTTP/1.1 200 Connection Established\r\nProxy-Agent: berth-egress\r\n\r\n")
        await client_writer.drain()
        try:
            await asyncio.wait_for(client_writer.start_tls(server_context), _TLS_TIMEOUT_S)
        except (OSError, ssl.SSLError, TimeoutError, ConnectionError):
            return  # the sandbox's client did not trust us or gave up: nothing was sent
        authority = host if port == 443 else f"{host}:{port}"
        if ":" in host:
            authority = f"[{host}]" if port == 443 else f"[{host}]:{port}"
        requests = asyncio.create_task(self._requests(client_reader, upstream_writer, authority, substitutions))
        responses = asyncio.create_task(_copy_raw(upstream_reader, client_writer))
        try:
            await asyncio.wait({requests, responses}, return_when=asyncio.FIRST_COMPLETED)
            if requests.done() and not responses.done() and requests.exception() is None:
                # The sandbox finished sending; its last response may still be coming.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(responses), _HEAD_TIMEOUT_S)
        finally:
            for task in (requests, responses):
                task.cancel()
            await asyncio.gather(requests, responses, return_exceptions=True)

    @staticmethod
    async def _requests(
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        authority: str,
        substitutions: Substitutions,
    ) -> None:
        while True:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _HEAD_TIMEOUT_S)
            except asyncio.IncompleteReadError:
                return
            rewritten = _rewrite_head(head, authority, _current(substitutions))
            writer.write(rewritten.data)
            await writer.drain()
            if rewritten.body == "length":
                await _copy_exactly(reader, writer, rewritten.length)
            elif rewritten.body == "chunked":
                await _copy_chunked(reader, writer)
            elif rewritten.body == "raw":
                await _copy_raw(reader, writer)
                return
