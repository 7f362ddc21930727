"""The broker core every MCP transport shares: id rewriting, the cached
handshake, and routing server messages to subscribers."""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import time
from typing import Any, Awaitable, Deque, Dict, List, Optional, Set

from ..processes import consume_result
from ..protocol import Json, OpError

MCP_MAX_LABEL = 128
MCP_MAX_LINE_BYTES = 32 * 1024 * 1024
MCP_SUBSCRIBER_QUEUE = 1024


def _jsonrpc_id(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def is_request(msg: Json) -> bool:
    return isinstance(msg.get("method"), str) and _jsonrpc_id(msg.get("id"))


def is_notification(msg: Json) -> bool:
    return isinstance(msg.get("method"), str) and "id" not in msg


def is_response(msg: Json) -> bool:
    return "method" not in msg and _jsonrpc_id(msg.get("id")) and ("result" in msg or "error" in msg)


def jsonrpc_error(msg_id: Any, code: int, message: str, data: Optional[Json] = None) -> Json:
    error: Json = {"code": code, "message": message}
    if data is not None:
        error["data"] = data
    return {"jsonrpc": "2.0", "id": msg_id, "error": error}


def mcp_label(req: Json) -> str:
    label = req.get("label")
    if not isinstance(label, str) or not 0 < len(label) <= MCP_MAX_LABEL or any(c.isspace() or not c.isprintable() for c in label):
        raise OpError("invalid_argument", "label must be 1-%d printable characters without spaces" % MCP_MAX_LABEL, param="label")
    return label


def mcp_message(req: Json) -> Json:
    message = req.get("message")
    if not isinstance(message, dict):
        raise OpError("invalid_argument", "message must be one JSON-RPC message object", param="message")
    return message


class McpSubscriber:
    """One ``mcp.subscribe`` stream: a bounded queue of server messages."""

    def __init__(self) -> None:
        self.queue: Deque[Json] = collections.deque()
        self.wakeup = asyncio.Event()
        self.closed = False
        self.dropped = 0
        # Server requests routed to this subscriber and not yet answered.
        self.owes: Set[Any] = set()

    def put(self, msg: Json) -> None:
        if len(self.queue) >= MCP_SUBSCRIBER_QUEUE:
            # A subscriber that stopped reading loses the oldest messages
            # rather than growing the daemon without bound.
            self.queue.popleft()
            self.dropped += 1
        self.queue.append(msg)
        self.wakeup.set()

    def close(self) -> None:
        self.closed = True
        self.wakeup.set()


class McpBroker:
    """One MCP server shared by every client of a label in this sandbox.

    Each ``mcp.request`` is its own client: its id is rewritten to a
    broker-wide integer on the way up and restored on the way back, so any
    number of callers can reuse the same ids concurrently. The first
    successful ``initialize`` is forwarded and its result cached; later ones
    are answered from the cache with their own id, and only the first
    ``notifications/initialized`` after an upstream handshake is forwarded.
    Server notifications go to every subscriber; a server request goes to
    the oldest subscriber, which answers it with ``mcp.notify``. With no
    subscriber the broker answers ``ping`` itself and fails any other server
    request at once (-32601), so the server never waits on nobody.
    """

    transport = ""

    def __init__(self, label: str) -> None:
        self.label = label
        self.started_at = time.time()
        self.exit_code: Optional[int] = None
        self.dead = False
        self.dead_reason = ""
        self.subscribers: List[McpSubscriber] = []
        self.done = asyncio.Event()
        self._ids = itertools.count(1)
        self._pending: Dict[int, "asyncio.Future[Json]"] = {}
        self._init_lock = asyncio.Lock()
        self._init_result: Optional[Json] = None
        self._init_params: Any = None
        self._initialized_sent = False
        self._routed: Dict[Any, McpSubscriber] = {}
        self._background: Set["asyncio.Task[Any]"] = set()

    # ------------------------------------------------------------ transport hooks

    async def _send(self, msg: Json) -> None:
        """Delivers one message upstream; a request's answer arrives through
        ``_from_upstream``."""
        raise NotImplementedError

    async def _send_request(self, msg: Json, upstream_id: int) -> None:
        await self._send(msg)

    def pid(self) -> Optional[int]:
        return None

    def kill(self) -> None:
        """Synchronous last resort for daemon shutdown."""

    async def stop(self) -> None:
        raise NotImplementedError

    async def close_upstream(self) -> bool:
        return False

    def stderr_tail(self) -> str:
        return ""

    # ------------------------------------------------------------ state

    @property
    def state(self) -> str:
        return "dead" if self.dead else "running"

    def describe(self) -> Json:
        return {
            "label": self.label,
            "transport": self.transport,
            "state": self.state,
            "pid": self.pid(),
            "started_at": self.started_at,
            "exit_code": self.exit_code,
            "clients": len(self.subscribers) + len(self._pending),
            "in_flight": len(self._pending),
            "stderr_tail": self.stderr_tail(),
        }

    def dead_error(self) -> OpError:
        detail = self.dead_reason or ("exit code %s" % self.exit_code)
        return OpError(
            "failed_precondition",
            "MCP server %s is dead (%s); it is not restarted" % (self.label, detail),
            reason="mcp_server_dead",
            param="label",
        )

    def mark_dead(self, exit_code: Optional[int], reason: str) -> None:
        if self.dead:
            return
        self.dead = True
        self.exit_code = exit_code
        self.dead_reason = reason
        error = self.dead_error()
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        for sub in self.subscribers:
            sub.close()
        self.done.set()

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(consume_result)

    # ------------------------------------------------------------ client side

    async def request(self, msg: Json) -> Json:
        if self.dead:
            raise self.dead_error()
        if msg.get("method") == "initialize":
            async with self._init_lock:
                if self._init_result is None:
                    response = await self._forward(msg)
                    result = response.get("result")
                    if isinstance(result, dict):
                        self._init_result = result
                        self._init_params = msg.get("params")
                        self._initialized_sent = False
                        self._handshake_done(result)
                    return response
            return {"jsonrpc": "2.0", "id": msg["id"], "result": json.loads(json.dumps(self._init_result))}
        return await self._forward(msg)

    def _handshake_done(self, result: Json) -> None:
        """Called once the first upstream handshake succeeded."""

    async def _forward(self, msg: Json) -> Json:
        upstream_id = next(self._ids)
        future: "asyncio.Future[Json]" = asyncio.get_running_loop().create_future()
        self._pending[upstream_id] = future
        upstream = dict(msg)
        upstream["id"] = upstream_id
        try:
            await self._send_request(upstream, upstream_id)
            response = await future
        except asyncio.CancelledError:
            if not self.dead and msg.get("method") != "initialize":
                cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": upstream_id, "reason": "the client went away"}}
                self._spawn(self._send_quietly(cancel))
            raise
        finally:
            self._pending.pop(upstream_id, None)
        out = dict(response)
        out["id"] = msg["id"]
        return out

    async def _send_quietly(self, msg: Json) -> None:
        try:
            await self._send(msg)
        except OpError:
            pass

    async def notify(self, msg: Json) -> bool:
        """Forwards a client notification, or a client's answer to a server
        request; returns whether anything went upstream."""
        if self.dead:
            raise self.dead_error()
        method = msg.get("method")
        if method == "notifications/initialized":
            if self._initialized_sent:
                return False
            self._initialized_sent = True
        elif method == "notifications/cancelled":
            # Its requestId is the client's own id, which is ambiguous across
            # clients; cancelling the mcp.request itself cancels upstream.
            return False
        elif method is None:
            sub = self._routed.pop(msg.get("id"), None)
            if sub is not None:
                sub.owes.discard(msg.get("id"))
        await self._send(msg)
        return True

    def subscribe(self) -> McpSubscriber:
        sub = McpSubscriber()
        if self.dead:
            sub.close()
        else:
            self.subscribers.append(sub)
        return sub

    def unsubscribe(self, sub: McpSubscriber) -> None:
        if sub in self.subscribers:
            self.subscribers.remove(sub)
        for server_id in list(sub.owes):
            # The subscriber left without answering: the server must not wait forever.
            self._routed.pop(server_id, None)
            self._reply_upstream(jsonrpc_error(server_id, -32603, "the client that received this request went away"))
        sub.owes.clear()

    # ------------------------------------------------------------ server side

    def _from_upstream(self, msg: Any) -> None:
        if isinstance(msg, list):
            for item in msg:
                self._from_upstream(item)
            return
        if not isinstance(msg, dict):
            return
        if isinstance(msg.get("method"), str):
            if "id" in msg:
                self._server_request(msg)
            else:
                for sub in self.subscribers:
                    sub.put(msg)
            return
        upstream_id = msg.get("id")
        future = self._pending.get(upstream_id) if isinstance(upstream_id, int) and not isinstance(upstream_id, bool) else None
        if future is not None and not future.done():
            future.set_result(msg)

    def _server_request(self, msg: Json) -> None:
        for sub in self.subscribers:
            if not sub.closed:
                sub.owes.add(msg["id"])
                self._routed[msg["id"]] = sub
                sub.put(msg)
                return
        if msg.get("method") == "ping":
            self._reply_upstream({"jsonrpc": "2.0", "id": msg["id"], "result": {}})
        else:
            self._reply_upstream(jsonrpc_error(msg["id"], -32601, "no client is connected to answer %s" % msg.get("method")))

    def _reply_upstream(self, msg: Json) -> None:
        if not self.dead:
            self._spawn(self._send_quietly(msg))
