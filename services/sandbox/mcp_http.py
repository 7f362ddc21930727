"""Environment-origin MCP servers over streamable HTTP, reached from the
sandbox's network.

The client is the ``mcp`` SDK's (``mcp.client.streamable_http`` on
``httpx2``); only its network layer is Berth's. ``SandboxNetwork`` is an
``httpcore2`` network backend whose every TCP connection is a
``net.connect`` tunnel: sandboxd, inside the sandbox, connects to the
target and relays the bytes over a daemon connection of their own. So the
connection originates in the sandbox's network namespace under its policy
(``disabled`` reaches only the sandbox's own loopback, ``enabled`` what its
egress filter allows, ``restricted`` only its egress proxy), and this
process never opens a socket to the server, nor to anything on the host's
network. TLS runs here, over the tunnel; names are resolved in the sandbox
(or, through a proxy, by the proxy).

``SandboxHttpBroker`` is the broker of one HTTP label: the same core as
sandboxd's stdio brokers (``sandboxd.mcp.broker``: id rewriting, the cached
handshake, routing server messages), over one SDK client session that all
callers of the label share. sandboxd keeps the label's registration (its
first configuration, and whether it is dead); ``SandboxHttpBrokers`` holds
the running brokers of one sandbox.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import anyio
import httpcore2
import httpx2
import mcp_types
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.inbound import MCP_PROTOCOL_VERSION_HEADER
from mcp.shared.message import ClientMessageMetadata, SessionMessage
from pydantic import ValidationError

from services.core.logging import get_logger
from services.sandbox.daemon.sandboxd.mcp.broker import McpBroker, jsonrpc_error
from services.sandbox.daemon.sandboxd.protocol import Json, OpError
from services.sandbox.daemon_client import DaemonClient, DaemonError, DaemonUnavailable, McpUpstream
from services.sandbox.states import McpBrokerState

__all__ = ["SandboxNetwork", "SandboxHttpBroker", "SandboxHttpBrokers", "sandbox_http_client"]

log = get_logger(__name__)

# JSON-RPC error code of a request the HTTP upstream never answered.
MCP_UPSTREAM_ERROR = -32000
# Connect/write bound, and the idle bound of one response stream.
_TIMEOUT = httpx2.Timeout(30.0, read=300.0)
_READ_SIZE = 64 * 1024


class _TunnelStream(httpcore2.AsyncNetworkStream):
    """One ``net.connect`` tunnel: the daemon connection's streams, past the
    daemon's answer."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            return await asyncio.wait_for(self._reader.read(max_bytes), timeout)
        except TimeoutError as exc:
            raise httpcore2.ReadTimeout(str(exc)) from exc
        except OSError as exc:
            raise httpcore2.ReadError(str(exc)) from exc

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        try:
            self._writer.write(buffer)
            await asyncio.wait_for(self._writer.drain(), timeout)
        except TimeoutError as exc:
            raise httpcore2.WriteTimeout(str(exc)) from exc
        except (OSError, RuntimeError) as exc:
            raise httpcore2.WriteError(str(exc)) from exc

    async def aclose(self) -> None:
        self._writer.close()

    async def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore2.AsyncNetworkStream:
        try:
            await asyncio.wait_for(self._writer.start_tls(ssl_context, server_hostname=server_hostname), timeout)
        except TimeoutError as exc:
            self._writer.close()
            raise httpcore2.ConnectTimeout(str(exc)) from exc
        except (OSError, ssl.SSLError) as exc:
            self._writer.close()
            raise httpcore2.ConnectError(str(exc)) from exc
        return self

    def get_extra_info(self, info: str) -> Any:
        if info == "ssl_object":
            return self._writer.get_extra_info("ssl_object")
        if info == "is_readable":
            # An idle pooled connection the server closed: not reusable.
            return self._reader.at_eof()
        return None


class SandboxNetwork(httpcore2.AsyncNetworkBackend):
    """Opens every connection from inside one sandbox, through its daemon."""

    def __init__(self, daemon: DaemonClient) -> None:
        self._daemon = daemon

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore2.AsyncNetworkStream:
        try:
            reader, writer = await asyncio.wait_for(self._daemon.open_tunnel(host, port), timeout)
        except TimeoutError as exc:
            raise httpcore2.ConnectTimeout(f"connecting to {host}:{port} from the sandbox timed out") from exc
        except DaemonError as exc:
            raise httpcore2.ConnectError(exc.message) from exc
        except DaemonUnavailable as exc:
            raise httpcore2.ConnectError(f"the sandbox daemon is unreachable: {exc}") from exc
        return _TunnelStream(reader, writer)

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore2.AsyncNetworkStream:
        raise httpcore2.ConnectError("unix sockets are not reachable through a sandbox")

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class _SandboxTransport(httpx2.AsyncHTTPTransport):
    """httpx2's own transport (its request and exception mapping) over a
    connection pool on ``SandboxNetwork``: httpx2 takes no network backend,
    so the pool it built is replaced by one that has it."""

    def __init__(self, network: SandboxNetwork, proxy: str | None, ca_bundle: Path | None) -> None:
        super().__init__(trust_env=False)
        context = ssl.create_default_context(cafile=str(ca_bundle) if ca_bundle is not None else None)
        if proxy is None:
            self._pool = httpcore2.AsyncConnectionPool(ssl_context=context, network_backend=network)
        else:
            self._pool = httpcore2.AsyncHTTPProxy(proxy_url=proxy, ssl_context=context, network_backend=network)


RequestHook = Callable[[httpx2.Request], Awaitable[None]]
ResponseHook = Callable[[httpx2.Response], Awaitable[None]]


def sandbox_http_client(
    daemon: DaemonClient,
    *,
    headers: dict[str, str],
    proxy: str | None,
    ca_bundle: Path | None = None,
    on_request: RequestHook | None = None,
    on_response: ResponseHook | None = None,
) -> httpx2.AsyncClient:
    """An httpx2 client whose connections all originate in the sandbox of
    ``daemon``; ``proxy`` (an http:// URL, from the sandbox's environment)
    is itself reached from the sandbox. TLS trusts ``ca_bundle`` (the
    sandboxes' bundle) or else the host's store. The host's proxy variables
    are not read."""
    if proxy is not None and not proxy.startswith(("http://", "https://")):
        raise OpError("invalid_argument", "the sandbox's proxy for this URL is not an http(s) URL", param="server_url")
    return httpx2.AsyncClient(
        transport=_SandboxTransport(SandboxNetwork(daemon), proxy, ca_bundle),
        headers=headers,
        timeout=_TIMEOUT,
        trust_env=False,
        event_hooks={"request": [on_request] if on_request else [], "response": [on_response] if on_response else []},
    )


def _describe(exc: BaseException) -> str:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return str(exc) or type(exc).__name__


class _Sender(Protocol):
    """The SDK transport's write stream."""

    async def send(self, item: SessionMessage, /) -> None: ...

    async def aclose(self) -> None: ...


class _Upstream:
    """One run of the SDK's client: one upstream MCP session."""

    def __init__(self) -> None:
        self.write: _Sender | None = None
        self.started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.task: asyncio.Task[None] | None = None
        self.pending: set[int] = set()
        # The server answered 404 to this session: it ended or forgot it.
        self.expired = False
        self.ended = False
        # Whether ending this run ends the server's session (HTTP DELETE).
        self.terminate = True


class SandboxHttpBroker(McpBroker):
    """One HTTP label's broker in the Sandbox service.

    The upstream session belongs to the broker, so all callers of the label
    share it. ``close_upstream`` ends it (HTTP DELETE); the next request
    re-runs the cached handshake on a fresh session and continues, as it
    does when the server answers 404 for an expired session. A request the
    server never answers (unreachable, connection lost) gets a JSON-RPC
    error (-32000) rather than failing the call.
    """

    transport = "http"

    def __init__(self, label: str, upstream: McpUpstream, daemon: DaemonClient, *, ca_bundle: Path | None = None) -> None:
        super().__init__(label)
        self._ca_bundle = ca_bundle
        self.url = upstream.server_url
        self.headers = dict(upstream.headers)
        self.proxy = upstream.proxy
        self._daemon = daemon
        self._upstream: _Upstream | None = None
        self._open_lock = asyncio.Lock()
        self._handshaken = False
        self.protocol_version: str | None = None
        # Params remembered by sandboxd: a handshake callers did before this
        # service restarted, replayed before their next request.
        self._init_params = upstream.init_params
        self._remembered = upstream.init_params is not None

    # ------------------------------------------------------------ the SDK client

    async def _run(self, up: _Upstream) -> None:
        error = f"the connection to MCP server {self.label} closed"
        try:

            async def on_request(request: httpx2.Request) -> None:
                if request.method == "DELETE" and not up.terminate:
                    # Abandoned (the sandbox goes away, the service stops):
                    # the SDK's DELETE on the way out is not sent.
                    raise _Abandoned()

            async def on_response(response: httpx2.Response) -> None:
                if response.status_code == 404 and "mcp-session-id" in response.request.headers:
                    up.expired = True

            client = sandbox_http_client(
                self._daemon,
                headers=self.headers,
                proxy=self.proxy,
                ca_bundle=self._ca_bundle,
                on_request=on_request,
                on_response=on_response,
            )
            async with client, streamable_http_client(self.url, http_client=client, terminate_on_close=True) as (read, write):
                up.write = write
                up.started.set_result(None)
                async for item in read:
                    if isinstance(item, Exception):
                        log.info("mcp_http_transport_error", label=self.label, error=_describe(item))
                        continue
                    self._from_upstream(item.message.model_dump(by_alias=True, mode="json", exclude_unset=True))
        except OpError as exc:
            error = exc.message
        except Exception as exc:
            error = f"MCP server {self.label} is unreachable: {_describe(exc)}"
            log.info("mcp_http_upstream_failed", label=self.label, error=error)
        finally:
            up.ended = True
            up.write = None
            if self._upstream is up:
                self._upstream = None
                self._handshaken = False
            if not up.started.done():
                up.started.set_result(None)
            for upstream_id in list(up.pending):
                self._fail_request(upstream_id, error)

    async def _open(self) -> _Upstream:
        up = _Upstream()
        self._upstream = up
        up.task = asyncio.create_task(self._run(up), name=f"mcp-http-{self.label}")
        await asyncio.shield(up.started)
        return up

    async def _deliver(self, up: _Upstream, msg: Json) -> None:
        try:
            message = mcp_types.jsonrpc_message_adapter.validate_python(msg)
        except ValidationError:
            raise OpError("invalid_argument", "message is not a valid JSON-RPC message", param="message") from None
        metadata = None
        if self.protocol_version is not None and msg.get("method") != "initialize":
            metadata = ClientMessageMetadata(headers={MCP_PROTOCOL_VERSION_HEADER: self.protocol_version})
        if up.write is None:
            raise _Gone()
        try:
            await up.write.send(SessionMessage(message, metadata=metadata))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            raise _Gone() from None

    async def _ready(self, *, replay: bool = True) -> _Upstream:
        """The running upstream, opened (and, with a known handshake,
        initialized again) when there is none."""
        async with self._open_lock:
            up = self._upstream
            needs_handshake = replay and not self._handshaken and self._init_params is not None
            if up is not None and not up.ended and not needs_handshake:
                return up
            if up is None or up.ended:
                up = await self._open()
                if up.ended:
                    raise _Gone()
            if needs_handshake:
                await self._replay_handshake(up)
            return up

    async def _replay_handshake(self, up: _Upstream) -> None:
        init_id = next(self._ids)
        future: asyncio.Future[Json] = asyncio.get_running_loop().create_future()
        self._pending[init_id] = future
        up.pending.add(init_id)
        try:
            await self._deliver(up, {"jsonrpc": "2.0", "id": init_id, "method": "initialize", "params": self._init_params})
            response = await future
        finally:
            self._pending.pop(init_id, None)
            up.pending.discard(init_id)
        result = response.get("result")
        if not isinstance(result, dict):
            raise OpError("unavailable", f"re-initializing MCP server {self.label} failed: {response.get('error')}")
        if self._init_result is None:
            self._init_result = result  # later initializes are answered from it
        self._handshake_done(result)
        await self._deliver(up, {"jsonrpc": "2.0", "method": "notifications/initialized"})
        self._initialized_sent = True

    def _handshake_done(self, result: Json) -> None:
        version = result.get("protocolVersion")
        self.protocol_version = version if isinstance(version, str) else None
        self._handshaken = True

    def _fail_request(self, upstream_id: int, message: str) -> None:
        future = self._pending.get(upstream_id)
        if future is not None and not future.done():
            future.set_result(jsonrpc_error(upstream_id, MCP_UPSTREAM_ERROR, message))

    # ------------------------------------------------------------ broker hooks

    async def _send_request(self, msg: Json, upstream_id: int) -> None:
        try:
            # A client's own initialize is the handshake: nothing to replay first.
            up = await self._ready(replay=msg.get("method") != "initialize")
            up.pending.add(upstream_id)
            await self._deliver(up, msg)
        except _Gone:
            self._fail_request(upstream_id, f"MCP server {self.label} is unreachable")
        except OpError as exc:
            if exc.code == "invalid_argument":
                raise
            self._fail_request(upstream_id, exc.message)

    async def _send(self, msg: Json) -> None:
        if self.dead:
            raise self.dead_error()
        try:
            await self._deliver(await self._ready(), msg)
        except _Gone:
            pass  # fire and forget: the next request reports the upstream
        except OpError as exc:
            if exc.code == "invalid_argument":
                raise
            log.info("mcp_http_notification_dropped", label=self.label, error=exc.message)

    async def request(self, msg: Json) -> Json:
        up = self._upstream
        response = await super().request(msg)
        if msg.get("method") != "initialize" and up is not None and up.expired and self._upstream is up:
            # The server ended the session: once more on a fresh one.
            await self._drop(up, terminate=False)
            response = await super().request(msg)
        if not self._remembered and self._init_params is not None:
            self._remembered = True
            try:
                await self._daemon.mcp_remember_handshake(self.label, self._init_params)
            except (DaemonError, DaemonUnavailable) as exc:
                log.warning("mcp_http_handshake_not_remembered", label=self.label, error=str(exc))
        return response

    async def _drop(self, up: _Upstream, *, terminate: bool) -> None:
        if self._upstream is up:
            self._upstream = None
            self._handshaken = False
        up.terminate = terminate
        if terminate and up.write is not None:
            await up.write.aclose()  # the SDK ends the session with DELETE
        elif up.task is not None:
            up.task.cancel()
        if up.task is not None:
            await asyncio.gather(up.task, return_exceptions=True)

    async def close_upstream(self) -> bool:
        up = self._upstream
        if up is None or up.ended:
            return False
        await self._drop(up, terminate=True)
        return True

    async def stop(self) -> None:
        if not self.dead:
            await self.close_upstream()
        self.mark_dead(None, "stopped")

    async def abandon(self) -> None:
        """Stops the client without ending the server's session."""
        up = self._upstream
        if up is not None:
            await self._drop(up, terminate=False)

    def kill(self) -> None:
        up = self._upstream
        if up is not None and up.task is not None:
            up.terminate = False
            up.task.cancel()
        self.mark_dead(None, "stopped")


class _Gone(Exception):
    """The upstream ended before the message could be sent."""


class _Abandoned(Exception):
    """Refuses the DELETE of an abandoned upstream."""


def _daemon_error(exc: OpError) -> DaemonError:
    return DaemonError(exc.code, exc.message, reason=exc.reason, param=exc.param)


class SandboxHttpBrokers:
    """The HTTP brokers of one sandbox, made on first use from sandboxd's
    registration of the label."""

    def __init__(self, daemon: DaemonClient, *, ca_bundle: Path | None = None) -> None:
        self._daemon = daemon
        self._ca_bundle = ca_bundle
        self._brokers: dict[str, SandboxHttpBroker] = {}
        self._stdio: set[str] = set()
        self._lock = asyncio.Lock()

    async def broker(self, label: str) -> SandboxHttpBroker | None:
        """The label's HTTP broker, or None for a stdio label (sandboxd
        serves those)."""
        broker = self._brokers.get(label)
        if broker is not None or label in self._stdio:
            return broker
        async with self._lock:
            if label in self._brokers or label in self._stdio:
                return self._brokers.get(label)
            upstream = await self._daemon.mcp_upstream(label)
            if upstream.transport != "http":
                self._stdio.add(label)
                return None
            broker = SandboxHttpBroker(label, upstream, self._daemon, ca_bundle=self._ca_bundle)
            if upstream.state == McpBrokerState.DEAD:
                broker.mark_dead(None, "stopped")
            self._brokers[label] = broker
            return broker

    def known(self, label: str) -> SandboxHttpBroker | None:
        return self._brokers.get(label)

    async def request(self, broker: SandboxHttpBroker, message: Json) -> Json:
        try:
            return await broker.request(message)
        except OpError as exc:
            raise _daemon_error(exc) from None

    async def notify(self, broker: SandboxHttpBroker, message: Json) -> bool:
        try:
            return await broker.notify(message)
        except OpError as exc:
            raise _daemon_error(exc) from None

    async def close(self) -> None:
        """Stops every client, leaving the servers' sessions alone (as a
        destroyed sandbox or a stopped service always did): the sandbox may
        be paused or gone, and a restarted service opens new sessions."""
        brokers, self._brokers = list(self._brokers.values()), {}
        for broker in brokers:
            await broker.abandon()
