"""The turn's items and events, persisted for the harness.

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

from sqlalchemy import Table, bindparam, exists, func, insert, select, update

from services.core.db import set_clause, set_params, start_tracked
from services.core.errors import NotFound
from services.core.ids import new_id
from services.session import views, wire
from services.session.agents import AgentConfig
from services.session.harness.context import compact_history, compaction_keep
from services.session.harness.io import ItemHandle
from services.session.harness.models.base import Entry, Usage
from services.session.models import FunctionCallRow, ItemRow, SessionRow, TurnRow
from services.session.store import Store, Unit

__all__ = ["TurnWriter", "TurnTakenOver", "OUTPUT_ITEM_TYPES", "dumps", "answer_unfinished_call"]


class TurnTakenOver(Exception):
    """The turn's row names another worker: this one lost its lease and
    another took the turn over, so this one writes nothing more."""

T = TypeVar("T")

# Item types that may appear in turn.item.done (the AgentOutputItem union).
OUTPUT_ITEM_TYPES = frozenset({"message", "function_call", "command_execution", "mcp_call", "reasoning", "web_search_call"})


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def answer_unfinished_call(entries: list[Entry], output: str) -> list[Entry] | None:
    """The entries of an open tool item whose call (its only entry) never
    got its result, with ``output`` as the result; None for other entries.
    A model API refuses a transcript with a call left unanswered."""
    calls = entries[0].get("tool_calls") if len(entries) == 1 else None
    if not calls:
        return None
    return [entries[0], {"role": "tool", "call_id": calls[0]["id"], "output": output}]


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
_TURNS = cast(Table, TurnRow.__table__)
# The turn's usage so far, saved with its next write so that a worker that
# takes the turn over counts the model calls made before it.
_SAVE_USAGE = update(_TURNS).where(_TURNS.c.id == bindparam("turn_id")).values(usage_json=bindparam("v_usage_json"))
# The same as _APPEND, fenced: only while the turn's row names this worker,
# so a worker whose turn was taken over cannot append after its successor.
# The turn row is read FOR SHARE (PostgreSQL; SQLite has one writer): an
# append and a takeover (an UPDATE of that row) serialize, and an append
# that waited re-reads the row as the takeover left it, so neither an
# append the takeover's reads missed nor one after it can commit.
_APPEND_FENCED = _APPEND.where(
    exists(
        select(_TURNS.c.id)
        .where(_TURNS.c.id == bindparam("v_turn_id"), _TURNS.c.worker_id == bindparam("v_worker_id"))
        .with_for_update(read=True)
    )
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
    # After a compaction: the items the model still sees.
    context_from: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.items or self.item_updates or self.calls or self.events or self.finished or self.context_from)


class TurnWriter:
    """Items, events and usage of one turn, and the agent configuration and
    transcript the turn's model calls read."""

    def __init__(
        self,
        store: Store,
        *,
        session_id: str,
        turn_id: str,
        agent_config_json: str,
        transcript: list[tuple[str, list[Entry]]],
        next_output_index: int = 0,
        worker_id: str = "",
        usage: dict[str, Any] | None = None,
    ) -> None:
        self.store = store
        # When set, every append is fenced on the turn naming this worker.
        self.worker_id = worker_id
        self.session_id = session_id
        self.turn_id = turn_id
        # The turn's usage, including a previous worker's when resumed.
        self.usage: dict[str, Any] | None = usage
        self._usage_unsaved = False
        self.open_items: dict[str, tuple[ItemHandle, dict[str, Any]]] = {}
        self.next_output_index = next_output_index
        self._config_json = agent_config_json
        self._config = views.agent_config_from_json(agent_config_json)
        # Model-facing entries per item, in item order, after compactions.
        self._transcript: dict[str, list[Entry]] = dict(compact_history(transcript))
        self._staged = _Staged()
        self._batching = False
        self._inflight: set[asyncio.Future[Any]] = set()
        # The write ``flush_behind`` started, until a later write waited for it.
        self._behind: asyncio.Future[None] | None = None

    async def transact(self, fn: Callable[[Unit], Awaitable[T]]) -> T:
        """One transaction whose completion ``settle`` waits for. It begins
        after the write ``flush_behind`` started, and raises that write's
        failure (a takeover, say) if it failed."""
        await self.written()
        return await self.store.transact(fn, inflight=self._inflight)

    async def written(self) -> None:
        """Waits for the write ``flush_behind`` started (and those before
        it); raises its failure, as often as it is asked, if it failed."""
        behind = self._behind
        if behind is not None:
            await asyncio.shield(behind)
            if self._behind is behind:
                self._behind = None

    async def settle(self) -> None:
        """Persists what is still staged, and waits for writes a cancel
        interrupted on the caller's side, so the turn's last events are in
        the log before its outcome."""
        self.flush_behind()
        if self._inflight:
            await asyncio.wait(set(self._inflight))

    # ----- reads ---------------------------------------------------------------
    async def agent_config(self) -> AgentConfig:
        return self._config

    async def transcript(self) -> list[Entry]:
        return [entry for entries in self._transcript.values() for entry in entries]

    async def transcript_items(self) -> list[tuple[str, list[Entry]]]:
        return list(self._transcript.items())

    def _set_entries(self, item_id: str, entries: list[Entry]) -> None:
        self._transcript[item_id] = list(entries)
        if compaction_keep(entries) is not None:
            self._transcript = dict(compact_history(list(self._transcript.items())))
            # The next turn loads the history from the oldest item still seen.
            self._staged.context_from = list(self._transcript)

    def _remember_config(self, config_json: str) -> None:
        if config_json != self._config_json:
            self._config_json = config_json
            self._config = views.agent_config_from_json(config_json)

    # ----- writes --------------------------------------------------------------
    async def append(self, u: Unit, events: list[dict[str, Any]]) -> None:
        """Appends scoped events to the log; reads the agent configuration
        back from the counter row on the way."""
        if not events:
            return
        params: dict[str, Any] = {"session_id": self.session_id, "v_count": len(events)}
        if self._usage_unsaved:
            # Before the fenced append, which reads the turn row FOR SHARE:
            # taking the row's write lock after that share could deadlock
            # with a concurrent append of this turn. If the fence fails, the
            # transaction rolls back.
            self._usage_unsaved = False
            await u.session.execute(_SAVE_USAGE, {"turn_id": self.turn_id, "v_usage_json": dumps(self.usage)})
        if self.worker_id:
            params |= {"v_turn_id": self.turn_id, "v_worker_id": self.worker_id}
        result = await u.session.execute(_APPEND_FENCED if self.worker_id else _APPEND, params)
        row = result.one_or_none()
        if row is None and self.worker_id:
            raise TurnTakenOver(f"turn {self.turn_id} is no longer run by worker {self.worker_id}")
        if row is None:
            raise NotFound(f"session {self.session_id} not found")
        self._remember_config(row.agent_config_json)
        u.append(self.session_id, int(row.event_seq), *events)

    async def flush(self) -> None:
        """Persists the staged writes in one transaction (at the end of a batch)."""
        if self._batching or not self._staged:
            return
        if self._behind is not None:
            # In order: after the write left behind.
            self.flush_behind()
            await self.written()
            return
        staged, self._staged = self._staged, _Staged()
        await self.transact(self._write(staged))

    def flush_behind(self) -> None:
        """Persists the staged writes in a task of its own, after the write
        started before it. A tool call's last result is written so while
        the next model request goes out: the harness needs none of it."""
        if self._batching or not self._staged:
            return
        staged, self._staged = self._staged, _Staged()
        write = self._write(staged)
        previous = self._behind

        async def run() -> None:
            if previous is not None:
                await previous
            await self.store.transact(write, inflight=self._inflight)

        # Its failure is raised by the next write (and retrieved if there is none).
        self._behind = start_tracked(run(), self._inflight)

    def _write(self, staged: _Staged) -> Callable[[Unit], Awaitable[None]]:
        async def write(u: Unit) -> None:
            if staged.items:
                await u.session.execute(_INSERT_ITEMS, list(staged.items.values()))
            u.session.add_all(staged.calls)
            for item_id, values in staged.item_updates.items():
                await u.session.execute(
                    _update_item(tuple(values)), {"item_id": item_id, **set_params(values)}
                )
            if staged.context_from:
                oldest = select(func.min(_ITEMS.c.pk)).where(_ITEMS.c.id.in_(staged.context_from)).scalar_subquery()
                await u.session.execute(
                    update(_SESSIONS).where(_SESSIONS.c.id == self.session_id).values(context_from_pk=oldest)
                )
            await self.append(u, staged.events)
            for item_id in staged.finished:
                self.open_items.pop(item_id, None)

        return write

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
            await self.flush()

    # ----- items and events ----------------------------------------------------
    def scoped(self, event: dict[str, Any]) -> dict[str, Any]:
        return {**event, "session_id": self.session_id, "turn_id": self.turn_id}

    def handle(self, output: bool) -> ItemHandle:
        """A new item's handle; ``output`` items take the next output index."""
        index = None
        if output:
            index = self.next_output_index
            self.next_output_index += 1
        return ItemHandle(new_id("item"), index)

    def item_row(
        self, handle: ItemHandle, item: dict[str, Any], entries: list[Entry], *, visible: bool
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The item's row (column values) and its wire form."""
        full = {"id": handle.id, **item, "turn_id": self.turn_id}
        row = {
            "id": handle.id,
            "session_id": self.session_id,
            "turn_id": self.turn_id,
            "type": str(item["type"]),
            "item_json": dumps(full),
            "model_json": dumps(entries),
            "visible": visible,
            "created_at": time.time(),
        }
        return row, full

    def remember_entries(self, item_id: str, entries: list[Entry]) -> None:
        """Adds an item persisted elsewhere to the model's transcript."""
        self._set_entries(item_id, entries)

    def stage_item(self, handle: ItemHandle, item: dict[str, Any], entries: list[Entry], *, visible: bool) -> dict[str, Any]:
        row, full = self.item_row(handle, item, entries, visible=visible)
        self._staged.items[handle.id] = row
        self._set_entries(handle.id, entries)
        return full

    def stage_call(self, call: FunctionCallRow) -> None:
        self._staged.calls.append(call)

    def stage_events(self, *events: dict[str, Any]) -> None:
        self._staged.events.extend(events)

    def _stage_item_update(self, item_id: str, **values: Any) -> None:
        row = self._staged.items.get(item_id)
        if row is not None:
            row.update(values)
        else:
            self._staged.item_updates.setdefault(item_id, {}).update(values)

    def added(self, handle: ItemHandle, full: dict[str, Any]) -> dict[str, Any]:
        event: dict[str, Any] = {"type": "agent.session.turn.item.added", "item": full}
        if handle.output_index is not None:
            event["output_index"] = handle.output_index
        return self.scoped(event)

    def done(self, handle: ItemHandle, full: dict[str, Any]) -> dict[str, Any]:
        return self.scoped({"type": "agent.session.turn.item.done", "item": full, "output_index": handle.output_index})

    async def add_item(
        self,
        item: dict[str, Any],
        *,
        entries: list[Entry],
        output: bool,
        done: bool,
        visible: bool = True,
        hold: bool = False,
    ) -> ItemHandle:
        handle = self.handle(output)
        full = self.stage_item(handle, item, entries, visible=visible)
        if visible:
            self._staged.events.append(self.added(handle, full))
            if done and output and full["type"] in OUTPUT_ITEM_TYPES:
                self._staged.events.append(self.done(handle, full))
            elif not done and output:
                # Tracked before it is written: a cancel arriving meanwhile
                # still finds the item to close.
                self.track_item(handle, item)
        if not hold:
            await self.flush()
        return handle

    def track_item(self, handle: ItemHandle, item: dict[str, Any]) -> None:
        self.open_items[handle.id] = (handle, dict(item))

    def full(self, handle: ItemHandle, item: dict[str, Any]) -> dict[str, Any]:
        """The item's wire form."""
        return {"id": handle.id, **{k: v for k, v in item.items() if k != "id"}, "turn_id": self.turn_id}

    async def store_item(self, u: Unit, handle: ItemHandle, item: dict[str, Any]) -> dict[str, Any] | None:
        """Rewrites a persisted item; None when it never was persisted."""
        full = self.full(handle, item)
        result = await u.session.execute(update(_ITEMS).where(_ITEMS.c.id == handle.id).values(item_json=dumps(full)))
        return full if result.rowcount else None  # type: ignore[attr-defined]

    async def insert_item(self, u: Unit, row: dict[str, Any]) -> None:
        await u.session.execute(insert(_ITEMS), [row])

    async def finish_item(self, handle: ItemHandle, item: dict[str, Any], *, entries: list[Entry], hold: bool = False) -> None:
        full = self.full(handle, item)
        self._stage_item_update(handle.id, item_json=dumps(full), model_json=dumps(entries))
        self._transcript[handle.id] = list(entries)
        if handle.output_index is not None and full["type"] in OUTPUT_ITEM_TYPES:
            self._staged.events.append(self.done(handle, full))
        self._staged.finished.append(handle.id)
        if not hold:
            await self.flush()

    async def close_open_items(self, u: Unit) -> None:
        """On a failed or cancelled turn: items still open end as incomplete
        (or failed, when the tool already reported failure)."""
        events: list[dict[str, Any]] = []
        for handle, item in list(self.open_items.values()):
            status = item.get("status")
            item["status"] = "failed" if status == "failed" and item["type"] != "message" else "incomplete"
            answered = answer_unfinished_call(self._transcript.get(handle.id, []), "error: the call did not finish")
            if answered is not None:
                self._transcript[handle.id] = answered
                await u.session.execute(update(_ITEMS).where(_ITEMS.c.id == handle.id).values(model_json=dumps(answered)))
            full = await self.store_item(u, handle, item)
            if full is not None and handle.output_index is not None and full["type"] in OUTPUT_ITEM_TYPES:
                events.append(self.done(handle, full))
        self.open_items.clear()
        await self.append(u, events)

    async def emit(self, *events: dict[str, Any]) -> None:
        self._staged.events.extend(self.scoped(e) for e in events)
        await self.flush()

    def record_usage(self, usage: Usage) -> None:
        self.usage = wire.add_usage(
            self.usage, wire.usage(usage.input_tokens, usage.output_tokens, usage.cached_tokens, usage.reasoning_tokens)
        )
        self._usage_unsaved = True
