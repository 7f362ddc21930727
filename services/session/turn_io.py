"""The database-backed ``TurnIO`` the harness runs against.

Writes are staged in memory and persisted in short transactions, none held
across model or environment calls: each write call is one transaction, or a
whole ``batch()`` block is. The agent configuration, the transcript and the
output-index counter live in memory for the turn (one turn runs at a time
per session, on one worker, and only it adds items), loaded with the claim.
Each event append reads the agent configuration back from the session
counter row it updates anyway, so a session update still applies to the
turn's next model call without a read of its own."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import grpc
from sqlalchemy import Table, bindparam, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from berth.environment.v1 import environment_pb2
from services.core.db import set_clause, set_params
from services.core.errors import NotFound, from_rpc_error
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
from services.session.states import SessionStatus, TurnStatus
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


# Hot-path writes are Core statements: the ORM's unit of work costs more
# CPU than the statements themselves.
_ITEMS = cast(Table, ItemRow.__table__)
_SESSIONS = cast(Table, SessionRow.__table__)
# Built once (see services/session/repository.py on prepared statements).
_INSERT_ITEMS = insert(_ITEMS)
_APPEND = (
    update(_SESSIONS)
    .where(_SESSIONS.c.id == bindparam("session_id"))
    .values(event_seq=_SESSIONS.c.event_seq + bindparam("v_count"))
    .returning(_SESSIONS.c.event_seq, _SESSIONS.c.agent_config_json)
)


@functools.cache
def _update_item(keys: tuple[str, ...]) -> Any:
    return update(_ITEMS).where(_ITEMS.c.id == bindparam("item_id")).values(set_clause(keys))


@dataclass
class _Staged:
    """Writes not yet persisted, in the order they were made."""

    # New item rows by ID (in order): finishing one only changes its row.
    items: dict[str, dict[str, Any]] = field(default_factory=dict)
    item_updates: dict[str, dict[str, Any]] = field(default_factory=dict)
    calls: list[FunctionCallRow] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    # Items that stop being open once this stage is persisted.
    finished: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.items or self.item_updates or self.calls or self.events or self.finished)


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
        agent_config_json: str,
        transcript: list[tuple[str, list[Entry]]],
        next_output_index: int = 0,
        mcp: McpConnections | None = None,
        on_ending: Callable[[], None] | None = None,
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
        self.next_output_index = next_output_index
        self.made_function_calls = False
        self._on_ending = on_ending
        self._config_json = agent_config_json
        self._config = views.agent_config_from_json(agent_config_json)
        # Model-facing entries per item, in item order.
        self._transcript: dict[str, list[Entry]] = dict(transcript)
        self._staged = _Staged()
        self._batching = False
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
        return self._config

    async def transcript(self) -> list[Entry]:
        return [entry for entries in self._transcript.values() for entry in entries]

    def _remember_config(self, config_json: str) -> None:
        if config_json != self._config_json:
            self._config_json = config_json
            self._config = views.agent_config_from_json(config_json)

    # ----- writes --------------------------------------------------------------
    async def _append(self, u: Unit, events: list[dict[str, Any]]) -> None:
        """Appends scoped events to the log; reads the agent configuration
        back from the counter row on the way."""
        if not events:
            return
        result = await u.session.execute(_APPEND, {"session_id": self.session_id, "v_count": len(events)})
        row = result.one_or_none()
        if row is None:
            raise NotFound(f"session {self.session_id} not found")
        self._remember_config(row.agent_config_json)
        u.append(self.session_id, int(row.event_seq), *events)

    async def _flush(self) -> None:
        """Persists the staged writes in one transaction (at the end of a batch)."""
        if self._batching or not self._staged:
            return
        staged, self._staged = self._staged, _Staged()

        async def write(u: Unit) -> None:
            if staged.items:
                await u.session.execute(_INSERT_ITEMS, list(staged.items.values()))
            u.session.add_all(staged.calls)
            for item_id, values in staged.item_updates.items():
                await u.session.execute(
                    _update_item(tuple(values)), {"item_id": item_id, **set_params(values)}
                )
            await self._append(u, staged.events)
            for item_id in staged.finished:
                self.open_items.pop(item_id, None)

        await self._transact(write)

    @contextlib.asynccontextmanager
    async def batch(self) -> AsyncIterator[None]:
        if self._batching:
            yield
            return
        self._batching = True
        try:
            yield
        finally:
            self._batching = False
            await self._flush()

    # ----- items and events ----------------------------------------------------
    def _scoped(self, event: dict[str, Any]) -> dict[str, Any]:
        return {**event, "session_id": self.session_id, "turn_id": self.turn_id}

    def _handle(self, output: bool) -> ItemHandle:
        index = None
        if output:
            index = self.next_output_index
            self.next_output_index += 1
        return ItemHandle(new_id("item"), index)

    def _item_row(
        self, handle: ItemHandle, item: dict[str, Any], entries: list[Entry], *, visible: bool
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The item's row (column values) and its wire form."""
        full = {"id": handle.id, **item, "turn_id": self.turn_id}
        row = {
            "id": handle.id,
            "session_id": self.session_id,
            "turn_id": self.turn_id,
            "type": str(item["type"]),
            "item_json": _dumps(full),
            "model_json": _dumps(entries),
            "visible": visible,
            "created_at": time.time(),
        }
        return row, full

    def _stage_item(self, handle: ItemHandle, item: dict[str, Any], entries: list[Entry], *, visible: bool) -> dict[str, Any]:
        row, full = self._item_row(handle, item, entries, visible=visible)
        self._staged.items[handle.id] = row
        self._transcript[handle.id] = list(entries)
        return full

    def _stage_item_update(self, item_id: str, **values: Any) -> None:
        row = self._staged.items.get(item_id)
        if row is not None:
            row.update(values)
        else:
            self._staged.item_updates.setdefault(item_id, {}).update(values)

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
        handle = self._handle(output)
        full = self._stage_item(handle, item, entries, visible=visible)
        if visible:
            self._staged.events.append(self._added(handle, full))
            if done and output and full["type"] in OUTPUT_ITEM_TYPES:
                self._staged.events.append(self._done(handle, full))
            elif not done and output:
                # Tracked before it is written: a cancel arriving meanwhile
                # still finds the item to close.
                self.track_item(handle, item)
        await self._flush()
        return handle

    def track_item(self, handle: ItemHandle, item: dict[str, Any]) -> None:
        self.open_items[handle.id] = (handle, dict(item))

    def _full(self, handle: ItemHandle, item: dict[str, Any]) -> dict[str, Any]:
        return {"id": handle.id, **{k: v for k, v in item.items() if k != "id"}, "turn_id": self.turn_id}

    async def _store_item(self, u: Unit, handle: ItemHandle, item: dict[str, Any]) -> dict[str, Any] | None:
        """Rewrites a persisted item; None when it never was persisted."""
        full = self._full(handle, item)
        result = await u.session.execute(update(_ITEMS).where(_ITEMS.c.id == handle.id).values(item_json=_dumps(full)))
        return full if result.rowcount else None  # type: ignore[attr-defined]

    async def finish_item(self, handle: ItemHandle, item: dict[str, Any], *, entries: list[Entry]) -> None:
        full = self._full(handle, item)
        self._stage_item_update(handle.id, item_json=_dumps(full), model_json=_dumps(entries))
        self._transcript[handle.id] = list(entries)
        if handle.output_index is not None and full["type"] in OUTPUT_ITEM_TYPES:
            self._staged.events.append(self._done(handle, full))
        self._staged.finished.append(handle.id)
        await self._flush()

    async def close_open_items(self, u: Unit) -> None:
        """On a failed or cancelled turn: items still open end as incomplete
        (or failed, when the tool already reported failure)."""
        events: list[dict[str, Any]] = []
        for handle, item in list(self.open_items.values()):
            status = item.get("status")
            item["status"] = "failed" if status == "failed" and item["type"] != "message" else "incomplete"
            full = await self._store_item(u, handle, item)
            if full is not None and handle.output_index is not None and full["type"] in OUTPUT_ITEM_TYPES:
                events.append(self._done(handle, full))
        self.open_items.clear()
        await self._append(u, events)

    async def emit(self, *events: dict[str, Any]) -> None:
        self._staged.events.extend(self._scoped(e) for e in events)
        await self._flush()

    def ending(self) -> None:
        if self._on_ending is not None:
            self._on_ending()

    def record_usage(self, usage: Usage) -> None:
        self.usage = wire.add_usage(
            self.usage, wire.usage(usage.input_tokens, usage.output_tokens, usage.cached_tokens, usage.reasoning_tokens)
        )

    # ----- application function calls ------------------------------------------
    async def add_function_call(self, name: str, arguments: str, model_call_id: str) -> str:
        call_id = new_id("call")
        item = {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments, "status": "in_progress"}
        entries = [{"role": "assistant", "tool_calls": [{"id": model_call_id, "name": name, "arguments": arguments}]}]
        handle = self._handle(True)
        full = self._stage_item(handle, item, entries, visible=True)
        # Registered in the transaction that makes item.added visible, so a
        # fast tool_result never races the registration.
        self._staged.calls.append(
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
        self._staged.events.append(self._added(handle, full))
        self._calls[call_id] = (model_call_id, handle, item)
        self.track_item(handle, item)
        self.made_function_calls = True
        await self._flush()
        return call_id

    async def _answered(self, call_ids: list[str]) -> list[FunctionCallRow] | None:
        async def read(s: AsyncSession) -> list[FunctionCallRow]:
            return list((await s.execute(select(FunctionCallRow).where(FunctionCallRow.call_id.in_(call_ids)))).scalars())

        rows = await self.store.query(read)
        if len(rows) == len(call_ids) and all(r.state == "answered" for r in rows):
            return rows
        return None

    async def _session_event(self, u: Unit, event_type: str, status: str) -> dict[str, Any]:
        row = await repo.get_session(u.session, self.org_id, self.session_id)
        view = await views.session_view(u.session, row, self.environment, status=status)
        return wire.session_event(event_type, view.message)

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
            events: list[dict[str, Any]] = []
            for result in results:
                model_call_id, handle, item = self._calls.pop(result.call_id)
                await u.session.execute(
                    update(FunctionCallRow)
                    .where(FunctionCallRow.call_id == result.call_id, FunctionCallRow.state == "answered")
                    .values(state="consumed")
                )
                done = self._full(handle, {**item, "status": "completed"})
                await u.session.execute(update(_ITEMS).where(_ITEMS.c.id == handle.id).values(item_json=_dumps(done)))
                self.open_items.pop(handle.id, None)
                events.append(self._done(handle, done))
                output_item = {
                    "type": "function_call_output",
                    "call_id": result.call_id,
                    "output": result.output if result.success else None,
                    "error": None if result.success else (result.error or "the function call failed"),
                    "status": "completed" if result.success else "failed",
                }
                entries: list[Entry] = [{"role": "tool", "call_id": model_call_id, "output": function_output_text(result)}]
                out_handle = self._handle(False)
                row, out_full = self._item_row(out_handle, output_item, entries, visible=True)
                await u.session.execute(insert(_ITEMS), [row])
                self._transcript[out_handle.id] = entries
                events.append(self._added(out_handle, out_full))
            if waited:
                await repo.set_turn_status(u.session, self.turn_id, (TurnStatus.WAITING,), status=TurnStatus.IN_PROGRESS)
                await u.session.execute(
                    update(SessionRow)
                    .where(SessionRow.id == self.session_id, SessionRow.active_turn_id == self.turn_id)
                    .values(status=SessionStatus.IN_PROGRESS, last_active_at=time.time())
                )
                events.append(await self._session_event(u, "agent.session.in_progress", SessionStatus.IN_PROGRESS))
            await self._append(u, events)

        await self._transact(record)
        return results

    async def _start_waiting(self, u: Unit) -> None:
        await repo.set_turn_status(u.session, self.turn_id, (TurnStatus.IN_PROGRESS,), status=TurnStatus.WAITING)
        await u.session.execute(
            update(SessionRow)
            .where(SessionRow.id == self.session_id, SessionRow.active_turn_id == self.turn_id)
            .values(status=SessionStatus.REQUIRES_ACTION, last_active_at=time.time())
        )
        await self._append(u, [await self._session_event(u, "agent.session.requires_action", SessionStatus.REQUIRES_ACTION)])

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
            failed = wire.environment_event("agent.session.environment.failed", self.session_id, self.turn_id, state)
            await self._append(u, [failed])

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
