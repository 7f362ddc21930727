"""The database-backed ``TurnIO`` the harness runs against: every item and
event is persisted in its own short transaction (no transaction is held
across model or environment calls)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from berth.environment.v1 import environment_pb2
from services.core.errors import from_rpc_error
from services.core.ids import new_id
from services.core.logging import get_logger
from services.session import repository as repo
from services.session import views, wire
from services.session.agents import AgentConfig
from services.session.environment_client import EnvironmentClient
from services.session.harness.io import FunctionResult, ItemHandle, McpClient, McpUnavailable, TurnFailure
from services.session.harness.models.base import Entry, Usage
from services.session.mcp_connections import (
    McpConnections,
    authorization_header,
    environment_transport,
    service_http_transport,
    transport_fingerprint,
)
from services.session.models import FunctionCallRow, ItemRow, SessionRow
from services.session.store import Store, Unit

__all__ = ["DbTurnIO", "OUTPUT_ITEM_TYPES", "function_output_text"]

log = get_logger(__name__)

T = TypeVar("T")

# Item types that may appear in turn.item.done (the AgentOutputItem union).
OUTPUT_ITEM_TYPES = frozenset({"message", "function_call", "command_execution", "mcp_call", "reasoning", "web_search_call"})

_POLL_S = 0.25


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def function_output_text(result: FunctionResult) -> str:
    """What the model sees for an application function result."""
    if not result.success:
        return f"error: {result.error or 'the function call failed'}"
    output = result.output
    if output is None:
        return ""
    if isinstance(output, str):
        return output
    parts: list[str] = []
    for part in output:
        if isinstance(part, dict) and part.get("type") == "input_text":
            parts.append(str(part.get("text", "")))
        elif isinstance(part, dict) and part.get("type") == "input_image":
            parts.append("[image]")
    return "\n".join(parts)


class DbTurnIO:
    def __init__(
        self,
        store: Store,
        env_client: EnvironmentClient | None,
        *,
        org_id: str,
        session_id: str,
        turn_id: str,
        environment_id: str | None,
        environment: environment_pb2.Environment | None,
        mcp: McpConnections | None = None,
    ) -> None:
        self.store = store
        self.mcp = mcp
        self._mcp_environment_lock = asyncio.Lock()
        self.org_id = org_id
        self.session_id = session_id
        self.turn_id = turn_id
        self.environment_id = environment_id
        self.env = env_client if environment_id else None
        self.environment = environment
        self.usage: dict[str, Any] | None = None
        self.open_items: dict[str, tuple[ItemHandle, dict[str, Any]]] = {}
        self._env_ready = False
        self._calls: dict[str, tuple[str, ItemHandle, dict[str, Any]]] = {}
        self._inflight: set[asyncio.Future[Any]] = set()

    async def _transact(self, fn: Callable[[Unit], Awaitable[T]]) -> T:
        return await self.store.transact(fn, inflight=self._inflight)

    async def settle(self) -> None:
        """Waits for writes a cancel interrupted on the caller's side, so the
        turn's last events are in the log before its outcome."""
        if self._inflight:
            await asyncio.wait(set(self._inflight))

    # ----- reads ---------------------------------------------------------------
    async def agent_config(self) -> AgentConfig:
        row = await self.store.query(lambda s: repo.get_session(s, self.org_id, self.session_id))
        return views.agent_config(row)

    async def transcript(self) -> list[Entry]:
        # One turn is active at a time and user messages become items when
        # their turn starts, so row order is conversation order.
        async def read(s: AsyncSession) -> list[str]:
            stmt = select(ItemRow.model_json).where(ItemRow.session_id == self.session_id).order_by(ItemRow.pk)
            return list((await s.execute(stmt)).scalars())

        entries: list[Entry] = []
        for model_json in await self.store.query(read):
            entries.extend(json.loads(model_json))
        return entries

    # ----- items and events ----------------------------------------------------
    def _scoped(self, event: dict[str, Any]) -> dict[str, Any]:
        return {**event, "session_id": self.session_id, "turn_id": self.turn_id}

    async def _insert_item(
        self, u: Unit, item: dict[str, Any], *, entries: list[Entry], output: bool, visible: bool
    ) -> tuple[ItemHandle, dict[str, Any]]:
        item_id = new_id("item")
        index = await repo.next_output_index(u.session, self.turn_id) if output else None
        full = {"id": item_id, **item, "turn_id": self.turn_id}
        u.session.add(
            ItemRow(
                id=item_id,
                session_id=self.session_id,
                turn_id=self.turn_id,
                type=str(item["type"]),
                item_json=_dumps(full),
                model_json=_dumps(entries),
                visible=visible,
                created_at=time.time(),
            )
        )
        return ItemHandle(item_id, index), full

    def _added(self, handle: ItemHandle, full: dict[str, Any]) -> dict[str, Any]:
        event: dict[str, Any] = {"type": "agent.session.turn.item.added", "item": full}
        if handle.output_index is not None:
            event["output_index"] = handle.output_index
        return self._scoped(event)

    def _done(self, handle: ItemHandle, full: dict[str, Any]) -> dict[str, Any]:
        return self._scoped({"type": "agent.session.turn.item.done", "item": full, "output_index": handle.output_index})

    async def add_item(
        self, item: dict[str, Any], *, entries: list[Entry], output: bool, done: bool, visible: bool = True
    ) -> ItemHandle:

        async def insert(u: Unit) -> ItemHandle:
            handle, full = await self._insert_item(u, item, entries=entries, output=output, visible=visible)
            if visible:
                events = [self._added(handle, full)]
                if done and output and full["type"] in OUTPUT_ITEM_TYPES:
                    events.append(self._done(handle, full))
                elif not done and output:
                    # Tracked as part of the transaction: a cancel arriving
                    # meanwhile still finds the item to close.
                    self.track_item(handle, item)
                await u.emit(self.session_id, *events)
            return handle

        return await self._transact(insert)

    def track_item(self, handle: ItemHandle, item: dict[str, Any]) -> None:
        self.open_items[handle.id] = (handle, dict(item))

    async def _store_item(self, u: Unit, handle: ItemHandle, item: dict[str, Any], entries: list[Entry] | None) -> dict[str, Any]:
        full = {"id": handle.id, **{k: v for k, v in item.items() if k != "id"}, "turn_id": self.turn_id}
        values: dict[str, Any] = {"item_json": _dumps(full)}
        if entries is not None:
            values["model_json"] = _dumps(entries)
        await u.session.execute(update(ItemRow).where(ItemRow.id == handle.id).values(**values))
        return full

    async def finish_item(self, handle: ItemHandle, item: dict[str, Any], *, entries: list[Entry]) -> None:

        async def store(u: Unit) -> None:
            full = await self._store_item(u, handle, item, entries)
            if handle.output_index is not None and full["type"] in OUTPUT_ITEM_TYPES:
                await u.emit(self.session_id, self._done(handle, full))
            self.open_items.pop(handle.id, None)

        await self._transact(store)

    async def close_open_items(self, u: Unit) -> None:
        """On a failed or cancelled turn: items still open end as incomplete
        (or failed, when the tool already reported failure)."""
        for handle, item in list(self.open_items.values()):
            status = item.get("status")
            item["status"] = "failed" if status == "failed" and item["type"] != "message" else "incomplete"
            full = await self._store_item(u, handle, item, None)
            if handle.output_index is not None and full["type"] in OUTPUT_ITEM_TYPES:
                await u.emit(self.session_id, self._done(handle, full))
        self.open_items.clear()

    async def emit(self, *events: dict[str, Any]) -> None:
        scoped = [self._scoped(e) for e in events]

        async def append(u: Unit) -> None:
            await u.emit(self.session_id, *scoped)

        await self._transact(append)

    def record_usage(self, usage: Usage) -> None:
        self.usage = wire.add_usage(
            self.usage, wire.usage(usage.input_tokens, usage.output_tokens, usage.cached_tokens, usage.reasoning_tokens)
        )

    # ----- application function calls ------------------------------------------
    async def add_function_call(self, name: str, arguments: str, model_call_id: str) -> str:
        call_id = new_id("call")
        item = {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments, "status": "in_progress"}
        entries = [{"role": "assistant", "tool_calls": [{"id": model_call_id, "name": name, "arguments": arguments}]}]

        async def register(u: Unit) -> None:
            handle, full = await self._insert_item(u, item, entries=entries, output=True, visible=True)
            # Registered before item.added is visible, so a fast tool_result
            # never races the registration.
            u.session.add(
                FunctionCallRow(
                    call_id=call_id,
                    session_id=self.session_id,
                    turn_id=self.turn_id,
                    item_id=handle.id,
                    name=name,
                    arguments=arguments,
                    state="pending",
                    success=False,
                    output_json="null",
                    error=None,
                    created_at=time.time(),
                )
            )
            await u.emit(self.session_id, self._added(handle, full))
            self._calls[call_id] = (model_call_id, handle, item)
            self.track_item(handle, item)

        await self._transact(register)
        return call_id

    async def _answered(self, call_ids: list[str]) -> list[FunctionCallRow] | None:
        async def read(s: AsyncSession) -> list[FunctionCallRow]:
            return list((await s.execute(select(FunctionCallRow).where(FunctionCallRow.call_id.in_(call_ids)))).scalars())

        rows = await self.store.query(read)
        if len(rows) == len(call_ids) and all(r.state == "answered" for r in rows):
            return rows
        return None

    async def _session_event(self, u: Unit, event_type: str, status: str) -> None:
        row = await repo.get_session(u.session, self.org_id, self.session_id)
        view = await views.session_view(u.session, row, self.environment, status=status)
        await u.emit(self.session_id, wire.session_event(event_type, view.wire))

    async def wait_function_results(self, call_ids: list[str]) -> list[FunctionResult]:
        wake = self.store.notifier.subscribe(f"calls:{self.turn_id}")
        waited = False
        try:
            rows = await self._answered(call_ids)
            if rows is None:
                waited = True
                await self._transact(self._start_waiting)
            while rows is None:
                # Local answers wake us at once; answers taken by another replica are polled.
                try:
                    await asyncio.wait_for(wake.wait(), _POLL_S)
                except TimeoutError:
                    pass
                wake.clear()
                rows = await self._answered(call_ids)
        finally:
            self.store.notifier.unsubscribe(f"calls:{self.turn_id}", wake)

        by_id = {r.call_id: r for r in rows}
        results = [
            FunctionResult(cid, by_id[cid].success, json.loads(by_id[cid].output_json), by_id[cid].error) for cid in call_ids
        ]

        async def record(u: Unit) -> None:
            for result in results:
                model_call_id, handle, item = self._calls.pop(result.call_id)
                await u.session.execute(
                    update(FunctionCallRow)
                    .where(FunctionCallRow.call_id == result.call_id, FunctionCallRow.state == "answered")
                    .values(state="consumed")
                )
                done = await self._store_item(u, handle, {**item, "status": "completed"}, None)
                self.open_items.pop(handle.id, None)
                await u.emit(self.session_id, self._done(handle, done))
                output_item = {
                    "type": "function_call_output",
                    "call_id": result.call_id,
                    "output": result.output if result.success else None,
                    "error": None if result.success else (result.error or "the function call failed"),
                    "status": "completed" if result.success else "failed",
                }
                entries = [{"role": "tool", "call_id": model_call_id, "output": function_output_text(result)}]
                out_handle, out_full = await self._insert_item(u, output_item, entries=entries, output=False, visible=True)
                await u.emit(self.session_id, self._added(out_handle, out_full))
            if waited:
                await repo.set_turn_status(u.session, self.turn_id, ("waiting",), status="in_progress")
                await u.session.execute(
                    update(SessionRow)
                    .where(SessionRow.id == self.session_id, SessionRow.active_turn_id == self.turn_id)
                    .values(status="in_progress", last_active_at=time.time())
                )
                await self._session_event(u, "agent.session.in_progress", "in_progress")

        await self._transact(record)
        return results

    async def _start_waiting(self, u: Unit) -> None:
        await repo.set_turn_status(u.session, self.turn_id, ("in_progress",), status="waiting")
        await u.session.execute(
            update(SessionRow)
            .where(SessionRow.id == self.session_id, SessionRow.active_turn_id == self.turn_id)
            .values(status="requires_action", last_active_at=time.time())
        )
        await self._session_event(u, "agent.session.requires_action", "requires_action")

    # ----- the environment ------------------------------------------------------
    def sandbox_failure(self, exc: BaseException) -> TurnFailure:
        detail = from_rpc_error(exc).message if isinstance(exc, grpc.RpcError) else str(exc)
        return TurnFailure(
            "sandbox_error",
            f"environment {self.environment_id} of session {self.session_id} failed: {detail}",
        )

    async def _environment_failed(self, env: environment_pb2.Environment | None, message: str) -> TurnFailure:
        code = env.error.code if env is not None and env.error.code else "setup_failed"
        state = wire.environment_state(str(self.environment_id), "failed", (code, message))

        async def record(u: Unit) -> None:
            await u.session.execute(update(SessionRow).where(SessionRow.id == self.session_id).values(error=message))
            await u.emit(
                self.session_id,
                wire.environment_event("agent.session.environment.failed", self.session_id, self.turn_id, state),
            )

        await self._transact(record)
        return TurnFailure("sandbox_error", message)

    @property
    def environment_ready(self) -> bool:
        """Whether the environment is known to be ready (setup never undoes that)."""
        return self._env_ready

    async def ensure_environment(self) -> None:
        if self._env_ready or self.env is None or self.environment_id is None:
            return
        if self.environment is not None and self.environment.status == environment_pb2.ENVIRONMENT_STATUS_READY:
            # Read when the turn was claimed; a ready environment stays ready.
            self._env_ready = True
            return
        try:
            env = await self.env.get_environment(self.environment_id)
        except grpc.aio.AioRpcError as exc:
            raise self.sandbox_failure(exc) from exc
        self.environment = env
        if env.status == environment_pb2.ENVIRONMENT_STATUS_READY:
            self._env_ready = True
            return
        if env.status == environment_pb2.ENVIRONMENT_STATUS_FAILED:
            raise await self._environment_failed(env, env.error.message or "environment setup failed")
        await self.emit(
            wire.environment_event(
                "agent.session.environment.pending",
                self.session_id,
                self.turn_id,
                wire.environment_state(self.environment_id, "pending"),
            )
        )
        try:
            env = await self.env.ensure_ready(self.environment_id)
        except grpc.aio.AioRpcError as exc:
            error = from_rpc_error(exc)
            if error.reason == "ENVIRONMENT_FAILED":
                raise await self._environment_failed(None, error.message) from exc
            raise self.sandbox_failure(exc) from exc
        self.environment = env
        if env.status != environment_pb2.ENVIRONMENT_STATUS_READY:
            raise await self._environment_failed(env, env.error.message or "environment setup failed")
        self._env_ready = True
        await self.emit(
            wire.environment_event(
                "agent.session.environment.ready",
                self.session_id,
                self.turn_id,
                wire.environment_state(self.environment_id, "ready"),
            )
        )


    # ----- MCP servers ------------------------------------------------------------
    async def mcp_connect(self, tool: dict[str, Any]) -> McpClient:
        label = str(tool["server_label"])
        transport: dict[str, Any] = dict(tool["transport"])
        if self.mcp is None:
            raise McpUnavailable(f"MCP server {label!r} cannot be reached: MCP is not configured in this service")
        # Stdio servers always run in the environment; HTTP ones only when asked to.
        if transport["type"] == "stdio" or tool.get("connection_origin") == "environment":
            return await self._environment_mcp(label, transport)
        headers = dict(transport.get("headers") or {})
        if transport.get("authorization"):
            headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
            headers["Authorization"] = authorization_header(str(transport["authorization"]))
        url = str(transport["server_url"])
        timeout_s = self.mcp.call_timeout_s
        return await self.mcp.connect(
            self.session_id,
            label,
            transport_fingerprint("service", "", transport),
            lambda: service_http_transport(url, headers, read_timeout_s=timeout_s),
        )

    async def _environment_mcp(self, label: str, transport: dict[str, Any]) -> McpClient:
        assert self.mcp is not None
        env, environment_id = self.env, self.environment_id
        if env is None or environment_id is None:
            raise McpUnavailable(f"MCP server {label!r} runs in the environment, and this session has none")
        # Servers connect concurrently; the environment's events are emitted once.
        async with self._mcp_environment_lock:
            await self.ensure_environment()
        try:
            server, _ = await env.start_mcp_server(environment_id, self.session_id, label, json.dumps(transport))
        except grpc.aio.AioRpcError as exc:
            error = from_rpc_error(exc)
            raise McpUnavailable(f"MCP server {label!r} could not start: {error.message}", reason=error.reason) from exc
        if server.state == environment_pb2.MCP_SERVER_STATE_DEAD:
            raise McpUnavailable(f"MCP server {label!r} is dead and is not restarted", reason="MCP_SERVER_DEAD")
        session_id, timeout_s = self.session_id, self.mcp.call_timeout_s

        async def send(message_json: str) -> str:
            return await env.send_mcp_message(environment_id, session_id, label, message_json, timeout_s=timeout_s)

        return await self.mcp.connect(
            self.session_id,
            label,
            transport_fingerprint("environment", environment_id, transport),
            lambda: environment_transport(send, label=label),
        )
