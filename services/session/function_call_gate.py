"""The turn's application function calls: each one is registered with its
item, and the turn waits (the session requires action) until every call of
a model response is answered, then records the outputs and resumes."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from berth.environment.v1 import environment_pb2
from services.core.ids import new_id
from services.core.events import wait_set
from services.session import repository as repo
from services.session import views, wire
from services.session.harness.io import FunctionResult, ItemHandle
from services.session.harness.models.base import Entry
from services.session.models import FunctionCallRow, SessionRow
from services.session.session_controls import PriceTable
from services.session.states import SessionStatus, TurnStatus
from services.session.store import Unit
from services.session.turn_writer import TurnWriter

__all__ = ["FunctionCallGate", "PendingFunctionCall", "function_output_text"]

_POLL_S = 0.25


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


@dataclass(frozen=True)
class PendingFunctionCall:
    """A function call a turn's previous worker registered and left
    unanswered: its public ID, the model's ID for it, and its item."""

    call_id: str
    model_call_id: str
    handle: ItemHandle
    item: dict[str, Any]


class FunctionCallGate:
    """``environment`` gives the session's environment snapshot, which the
    session events of waiting and resuming render."""

    def __init__(
        self,
        writer: TurnWriter,
        *,
        org_id: str,
        environment: Callable[[], environment_pb2.Environment | None],
        prices: PriceTable,
    ) -> None:
        self._writer = writer
        self._prices = prices
        self._org_id = org_id
        self._environment = environment
        self.made_function_calls = False
        self._calls: dict[str, tuple[str, ItemHandle, dict[str, Any]]] = {}

    async def add_function_call(self, name: str, arguments: str, model_call_id: str) -> str:
        w = self._writer
        call_id = new_id("call")
        item = {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments, "status": "in_progress"}
        entries = [{"role": "assistant", "tool_calls": [{"id": model_call_id, "name": name, "arguments": arguments}]}]
        handle = w.handle(True)
        full = w.stage_item(handle, item, entries, visible=True)
        # Registered in the transaction that makes item.added visible, so a
        # fast tool_result never races the registration.
        w.stage_call(
            FunctionCallRow(
                call_id=call_id,
                session_id=w.session_id,
                turn_id=w.turn_id,
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
        w.stage_events(w.added(handle, full))
        self._calls[call_id] = (model_call_id, handle, item)
        w.track_item(handle, item)
        self.made_function_calls = True
        await w.flush()
        return call_id

    async def resume_waiting(self, calls: list[PendingFunctionCall], *, already_waiting: bool) -> list[FunctionResult]:
        """For a turn taken over from a worker that died: registers the calls
        it left unanswered and waits for their results as it did. When the
        turn was already waiting, the session's ``requires_action`` was
        announced: it is not announced again."""
        for call in calls:
            self._calls[call.call_id] = (call.model_call_id, call.handle, call.item)
            self._writer.track_item(call.handle, call.item)
        self.made_function_calls = True
        return await self.wait_function_results([c.call_id for c in calls], already_waiting=already_waiting)

    async def _answered(self, call_ids: list[str]) -> list[FunctionCallRow] | None:
        async def read(s: AsyncSession) -> list[FunctionCallRow]:
            return list((await s.execute(select(FunctionCallRow).where(FunctionCallRow.call_id.in_(call_ids)))).scalars())

        rows = await self._writer.store.query(read)
        if len(rows) == len(call_ids) and all(r.state == "answered" for r in rows):
            return rows
        return None

    async def _session_event(self, u: Unit, event_type: str, status: str) -> dict[str, Any]:
        row = await repo.get_session(u.session, self._org_id, self._writer.session_id)
        view = await views.session_view(u.session, row, self._environment(), prices=self._prices, status=status)
        return wire.session_event(event_type, view.message)

    async def wait_function_results(self, call_ids: list[str], *, already_waiting: bool = False) -> list[FunctionResult]:
        w = self._writer
        notifier = w.store.notifier
        wake = notifier.subscribe(f"calls:{w.turn_id}")
        waited = already_waiting
        try:
            rows = await self._answered(call_ids)
            if rows is None and not waited:
                waited = True
                await w.transact(self._start_waiting)
            while rows is None:
                # Answers wake us at once (from other replicas when the notifier hears them); polling is the fallback.
                await wait_set(wake, notifier.poll_s(_POLL_S))
                wake.clear()
                rows = await self._answered(call_ids)
        finally:
            notifier.unsubscribe(f"calls:{w.turn_id}", wake)

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
                completed = {**item, "status": "completed"}
                await w.store_item(u, handle, completed)
                done = w.full(handle, completed)
                w.open_items.pop(handle.id, None)
                events.append(w.done(handle, done))
                output_item = {
                    "type": "function_call_output",
                    "call_id": result.call_id,
                    "output": result.output if result.success else None,
                    "error": None if result.success else (result.error or "the function call failed"),
                    "status": "completed" if result.success else "failed",
                }
                entries: list[Entry] = [{"role": "tool", "call_id": model_call_id, "output": function_output_text(result)}]
                out_handle = w.handle(False)
                row, out_full = w.item_row(out_handle, output_item, entries, visible=True)
                await w.insert_item(u, row)
                w.remember_entries(out_handle.id, entries)
                events.append(w.added(out_handle, out_full))
            if waited:
                await repo.set_turn_status(u.session, w.turn_id, (TurnStatus.WAITING,), status=TurnStatus.IN_PROGRESS)
                await u.session.execute(
                    update(SessionRow)
                    .where(SessionRow.id == w.session_id, SessionRow.active_turn_id == w.turn_id)
                    .values(status=SessionStatus.IN_PROGRESS, last_active_at=time.time())
                )
                events.append(await self._session_event(u, "agent.session.in_progress", SessionStatus.IN_PROGRESS))
            await w.append(u, events)

        await w.transact(record)
        return results

    async def _start_waiting(self, u: Unit) -> None:
        w = self._writer
        await repo.set_turn_status(u.session, w.turn_id, (TurnStatus.IN_PROGRESS,), status=TurnStatus.WAITING)
        await u.session.execute(
            update(SessionRow)
            .where(SessionRow.id == w.session_id, SessionRow.active_turn_id == w.turn_id)
            .values(status=SessionStatus.REQUIRES_ACTION, last_active_at=time.time())
        )
        await w.append(u, [await self._session_event(u, "agent.session.requires_action", SessionStatus.REQUIRES_ACTION)])
