"""Byte relays: the egress relay of a ``restricted`` sandbox, and
``net.connect`` tunnels.

``net.connect {host, port}`` connects to ``host:port`` from inside the
sandbox, so under its network namespace and policy exactly as one of its
commands would (a ``disabled`` sandbox reaches only its own loopback, an
``enabled`` one what its egress filter lets through, a ``restricted`` one
only its proxy at ``127.0.0.1:3128``). It must be a connection's first
request: the answer is ``{"ok": true}`` (or an error, with reason
``connect_failed`` when the target cannot be reached), after which the
connection stops carrying frames and carries the TCP stream's bytes in both
directions until either side ends. The Sandbox service's MCP HTTP client
opens every one of its connections this way.

``egress.relay {port, socket}`` listens on ``127.0.0.1:port`` (0 picks a
port) and relays every connection, byte for byte, to the unix socket
``socket``: a ``restricted`` sandbox has no network of its own, and that
socket is its egress proxy, served by the Sandbox service from outside.
Answers ``{"port"}``; asking again for the same socket returns the running
relay. When the socket is missing (the service restarts) a connection is
closed at once.
"""

from __future__ import annotations

import asyncio
from typing import Any, Dict, Optional

from .protocol import Handler, Json, OpError, Sender, encode_frame, log, opt_int, req_str

_READ_SIZE = 64 * 1024
_CONNECT_TIMEOUT_S = 30.0


async def _copy_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copies until EOF, then half-closes; an error closes ``writer`` so the
    opposite direction ends too."""
    try:
        while True:
            data = await reader.read(_READ_SIZE)
            if not data:
                break
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()


class EgressRelay:
    """A loopback TCP listener whose connections go to a unix socket."""

    def __init__(self, port: int, socket_path: str) -> None:
        self.port = port
        self.socket_path = socket_path
        self.server: Optional[Any] = None
        self.ready: "asyncio.Future[None]" = asyncio.get_running_loop().create_future()

    async def start(self) -> None:
        try:
            self.server = await asyncio.start_server(self._on_client, "127.0.0.1", self.port, reuse_address=True)
        except BaseException as exc:
            self.ready.set_exception(exc)
            self.ready.exception()  # retrieved: a failed start is reported by its own request
            raise
        self.port = self.server.sockets[0].getsockname()[1]
        self.ready.set_result(None)

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_unix_connection(self.socket_path)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(_copy_stream(reader, upstream_writer), _copy_stream(upstream_reader, writer))
        finally:
            upstream_writer.close()
            writer.close()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


class Relays:
    """The ``egress.relay`` op: at most one relay per sandbox."""

    def __init__(self) -> None:
        self.egress_relay: Optional[EgressRelay] = None

    def handlers(self) -> Dict[str, Handler]:
        return {"egress.relay": self._op_egress_relay}

    def close(self) -> None:
        if self.egress_relay is not None:
            self.egress_relay.close()

    async def _op_egress_relay(self, conn: Sender, rid: int, req: Json) -> Json:
        port = opt_int(req, "port", 0) or 0
        target = req_str(req, "socket")
        if not 0 <= port <= 65535:
            raise OpError("invalid_argument", "port must be between 0 and 65535", param="port")
        relay = self.egress_relay
        if relay is not None:
            if relay.socket_path == target and port in (0, relay.port):
                await relay.ready
                return {"ok": True, "port": relay.port}
            raise OpError("failed_precondition", "an egress relay already listens on port %d" % relay.port)
        relay = self.egress_relay = EgressRelay(port, target)
        try:
            await relay.start()
        except OSError as exc:
            self.egress_relay = None
            raise OpError("failed_precondition", "cannot listen on 127.0.0.1:%d: %s" % (port, exc)) from None
        log("egress relay on 127.0.0.1:%d to %s" % (relay.port, target))
        return {"ok": True, "port": relay.port}


def _tunnel_target(req: Json) -> "tuple[str, int]":
    host = req_str(req, "host")
    if not 0 < len(host) <= 255 or any(c.isspace() or not c.isprintable() for c in host):
        raise OpError("invalid_argument", "host must be 1-255 printable characters without spaces", param="host")
    port = opt_int(req, "port", None)
    if port is None or not 0 < port <= 65535:
        raise OpError("invalid_argument", "port must be between 1 and 65535", param="port")
    return host, port


async def tunnel(rid: int, req: Json, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Serves ``net.connect`` on a connection that carries nothing else:
    answers it, then relays bytes between the connection and the target."""
    try:
        host, port = _tunnel_target(req)
        try:
            upstream_reader, upstream_writer = await asyncio.wait_for(asyncio.open_connection(host, port), _CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError, UnicodeError) as exc:
            raise OpError("failed_precondition", "cannot connect to %s:%d from the sandbox: %s" % (host, port, exc or "timed out"), reason="connect_failed") from None
    except OpError as exc:
        writer.write(encode_frame({"id": rid, "final": True, "error": exc.frame()}))
        await writer.drain()
        return
    try:
        writer.write(encode_frame({"id": rid, "final": True, "ok": True}))
        await writer.drain()
        await asyncio.gather(_copy_stream(reader, upstream_writer), _copy_stream(upstream_reader, writer))
    finally:
        upstream_writer.close()
