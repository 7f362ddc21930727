"""Berth as an MCP client: one official ``mcp.ClientSession`` per session and
server_label, kept open across the session's turns.

- Service-origin HTTP servers are reached from this process with the SDK's
  streamable HTTP transport, outside every sandbox. Each session has its own
  connection and credentials, even on a shared environment.
- Environment-origin servers (stdio, and HTTP with ``connection_origin:
  "environment"``) run behind the environment's broker in the sandbox. The
  ClientSession talks to them over ``environment_transport``: memory streams
  whose JSON-RPC messages each go through EnvironmentService.SendMcpMessage,
  with the responses fed back. The broker shares the server between sessions
  (first configuration wins), answers a later ``initialize`` from its cache
  and rewrites request ids, so each session runs an ordinary MCP handshake.

A session's connections close when it is deleted, and all of them when the
service stops. Connections live in the process that ran the session's turns;
another replica deleting the session does not reach them (they close with
this process, or when a later turn finds them broken).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import anyio
import httpx2
import mcp_types
from mcp import ClientSession
from mcp.client._transport import TransportStreams
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.message import SessionMessage
from pydantic import ValidationError

from services.core.errors import BerthError
from services.core.logging import get_logger
from services.session.harness.io import McpUnavailable

__all__ = [
    "McpConnection",
    "McpConnections",
    "environment_transport",
    "service_http_transport",
    "authorization_header",
    "UPSTREAM_ERROR",
]

log = get_logger(__name__)

# JSON-RPC "server error" code for a message the Environment service could not
# deliver (e.g. MCP_SERVER_DEAD); ``data.reason`` carries the domain reason.
UPSTREAM_ERROR = -32000
_CLIENT_INFO = mcp_types.Implementation(name="berth", version="0.1.0")
_CLOSE_TIMEOUT_S = 10.0

Opener = Callable[[], AbstractAsyncContextManager[TransportStreams]]
SendMessage = Callable[[str], Awaitable[str]]


def authorization_header(value: str) -> str:
    """The ``authorization`` of an MCP transport is a token; a value that
    already names its scheme ("Basic ...") is sent as given."""
    value = value.strip()
    return value if " " in value else f"Bearer {value}"


def _dump(message: mcp_types.JSONRPCMessage) -> str:
    return message.model_dump_json(by_alias=True, exclude_unset=True)


def _error_response(request_id: mcp_types.RequestId, message: str, data: dict[str, Any]) -> mcp_types.JSONRPCError:
    return mcp_types.JSONRPCError(
        jsonrpc="2.0", id=request_id, error=mcp_types.ErrorData(code=UPSTREAM_ERROR, message=message, data=data)
    )


@asynccontextmanager
async def environment_transport(send: SendMessage, *, label: str) -> AsyncIterator[TransportStreams]:
    """A client transport whose wire is ``send``: one JSON-RPC message out,
    the response to a request back. Requests run concurrently; notifications
    and responses go out in order, so ``notifications/initialized`` reaches
    the server before the next request. A ``notifications/cancelled`` from the
    client cancels the matching in-flight call instead of being sent (the
    broker cannot map client ids); cancelling the call makes the broker
    cancel the request upstream."""
    to_client, from_transport = anyio.create_memory_object_stream[SessionMessage | Exception](64)
    to_transport, from_client = anyio.create_memory_object_stream[SessionMessage](64)
    inflight: dict[mcp_types.RequestId, anyio.CancelScope] = {}

    async def answer(request: mcp_types.JSONRPCRequest) -> None:
        with anyio.CancelScope() as scope:
            inflight[request.id] = scope
            try:
                reply = await send(_dump(request))
                response: mcp_types.JSONRPCMessage = (
                    mcp_types.jsonrpc_message_adapter.validate_json(reply, by_name=False)
                    if reply
                    else _error_response(request.id, f"MCP server {label} sent no response", {})
                )
            except BerthError as error:
                code = error.received_code or error.grpc_code
                response = _error_response(request.id, error.message, {"reason": error.reason, "status": code.name})
            except ValidationError:
                response = _error_response(request.id, f"MCP server {label} sent an invalid JSON-RPC message", {})
            finally:
                inflight.pop(request.id, None)
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                await to_client.send(SessionMessage(response))

    async def pump(group: anyio.abc.TaskGroup) -> None:
        async with from_client:
            async for item in from_client:
                message = item.message
                if isinstance(message, mcp_types.JSONRPCRequest):
                    group.start_soon(answer, message)
                    continue
                if isinstance(message, mcp_types.JSONRPCNotification) and message.method == "notifications/cancelled":
                    params = message.params if isinstance(message.params, Mapping) else {}
                    scope = inflight.get(params.get("requestId"))  # type: ignore[arg-type]
                    if scope is not None:
                        scope.cancel()
                    continue
                try:
                    await send(_dump(message))
                except BerthError as exc:
                    log.warning("mcp_message_not_delivered", label=label, reason=exc.reason, error=exc.message)

    async with to_client, from_transport, to_transport, anyio.create_task_group() as group:
        group.start_soon(pump, group)
        try:
            yield from_transport, to_transport
        finally:
            group.cancel_scope.cancel()


@asynccontextmanager
async def service_http_transport(url: str, headers: Mapping[str, str], *, read_timeout_s: float) -> AsyncIterator[TransportStreams]:
    """The SDK's streamable HTTP transport with this session's headers; its
    upstream session is ended (HTTP DELETE) when the connection closes."""
    timeout = httpx2.Timeout(30.0, read=read_timeout_s)
    async with httpx2.AsyncClient(headers=dict(headers), timeout=timeout) as http:
        async with streamable_http_client(url, http_client=http, terminate_on_close=True) as streams:
            yield streams


def _describe(exc: BaseException | None) -> str:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if exc is None:
        return "the connection closed"
    text = str(exc) or type(exc).__name__
    return text


class McpConnection:
    """One initialized ClientSession, run by a task of its own (its anyio
    task group must be entered and left by the same task); other tasks call
    through it."""

    def __init__(self, label: str, fingerprint: str, opener: Opener, *, call_timeout_s: float) -> None:
        self.label = label
        self.fingerprint = fingerprint
        self.tools: list[mcp_types.Tool] = []
        self._opener = opener
        self._call_timeout_s = call_timeout_s
        self._session: ClientSession | None = None
        self._ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._error: BaseException | None = None

    @property
    def alive(self) -> bool:
        return self._session is not None and self._task is not None and not self._task.done()

    async def open(self, timeout_s: float) -> None:
        """Connects, initializes and lists the tools; raises McpUnavailable."""
        self._task = asyncio.create_task(self._run(), name=f"mcp-{self.label}")
        try:
            async with asyncio.timeout(timeout_s):
                await self._ready.wait()
                if self._session is None:
                    raise McpUnavailable(f"MCP server {self.label!r} did not initialize: {_describe(self._error)}")
                await self.refresh_tools()
        except TimeoutError:
            await self.close()
            raise McpUnavailable(f"MCP server {self.label!r} did not initialize within {timeout_s:g}s") from None
        except BaseException:
            await self.close()
            raise

    async def _run(self) -> None:
        try:
            async with self._opener() as (read, write):
                async with ClientSession(read, write, client_info=_CLIENT_INFO) as session:
                    await session.initialize()
                    self._session = session
                    self._ready.set()
                    await self._stop.wait()
        except Exception as exc:  # reported to whoever waits on open()
            self._error = exc
        finally:
            self._session = None
            self._ready.set()

    def _require(self) -> ClientSession:
        if self._session is None:
            raise McpUnavailable(f"MCP server {self.label!r} is disconnected: {_describe(self._error)}")
        return self._session

    async def refresh_tools(self) -> list[mcp_types.Tool]:
        session = self._require()
        tools: list[mcp_types.Tool] = []
        cursor: str | None = None
        while True:
            params = mcp_types.PaginatedRequestParams(cursor=cursor) if cursor else None
            result = await session.list_tools(params=params)
            tools.extend(result.tools)
            cursor = result.next_cursor
            if not cursor:
                break
        self.tools = tools
        return tools

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> mcp_types.CallToolResult:
        result = await self._require().call_tool(name, arguments, read_timeout_seconds=self._call_timeout_s)
        assert isinstance(result, mcp_types.CallToolResult)
        return result

    async def close(self) -> None:
        self._stop.set()
        task = self._task
        if task is None or task.done():
            return
        try:
            await asyncio.wait_for(asyncio.shield(task), _CLOSE_TIMEOUT_S)
        except TimeoutError:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


class McpConnections:
    """The live connections of this process, by (session, server_label)."""

    def __init__(self, *, call_timeout_s: float, connect_timeout_s: float) -> None:
        self.call_timeout_s = call_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._connections: dict[tuple[str, str], McpConnection] = {}
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._closing = False

    async def connect(self, session_id: str, label: str, fingerprint: str, opener: Opener) -> McpConnection:
        """The session's connection to the label, reused while it works and
        its configuration is unchanged; its tool list is refreshed."""
        if self._closing:
            raise McpUnavailable("the session service is stopping")
        key = (session_id, label)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            current = self._connections.get(key)
            if current is not None and current.alive and current.fingerprint == fingerprint:
                try:
                    async with asyncio.timeout(self.connect_timeout_s):
                        await current.refresh_tools()
                    return current
                except Exception as exc:
                    log.info("mcp_connection_reopened", session_id=session_id, label=label, error=_describe(exc))
            if current is not None:
                del self._connections[key]
                await current.close()
            connection = McpConnection(label, fingerprint, opener, call_timeout_s=self.call_timeout_s)
            await connection.open(self.connect_timeout_s)
            self._connections[key] = connection
            log.info("mcp_connection_opened", session_id=session_id, label=label, tools=len(connection.tools))
            return connection

    async def close_session(self, session_id: str) -> None:
        keys = [k for k in self._connections if k[0] == session_id]
        for key in keys:
            connection = self._connections.pop(key, None)
            self._locks.pop(key, None)
            if connection is not None:
                await connection.close()
        if keys:
            log.info("mcp_connections_closed", session_id=session_id, count=len(keys))

    async def close(self) -> None:
        self._closing = True
        connections = list(self._connections.values())
        self._connections.clear()
        self._locks.clear()
        await asyncio.gather(*(c.close() for c in connections), return_exceptions=True)


def transport_fingerprint(origin: str, environment_id: str, transport: Mapping[str, Any]) -> str:
    """Configuration that selects a connection: an environment-origin label
    reaches whatever the broker runs, so only the environment matters; a
    service-origin connection is the URL and credentials."""
    if origin == "environment":
        return json.dumps(["environment", environment_id])
    return json.dumps(["service", dict(transport)], sort_keys=True)


__all__ += ["transport_fingerprint"]
