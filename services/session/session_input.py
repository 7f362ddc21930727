"""Session input: queued turns, cancellation and function call results,
applied in one transaction per submission."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import Table, insert, select, update

from berth.session.v1 import session_service_pb2
from services.core.errors import Conflict, FailedPrecondition, InvalidArgument, NotFound
from services.core.ids import new_id
from services.core.structs import from_value
from services.core.wire_json import to_wire
from services.session.harness.trace import current_link
from services.session.session_controls import PriceTable, refuse_input_past_limit
from services.session import repository as repo
from services.session import views, wire
from services.session.models import FunctionCallRow, SessionRow, TurnRow
from services.session.runner import ClaimedTurn, TurnRunner
from services.session.states import RUNNING_TURN_STATUSES, TurnStatus
from services.session.store import Store, Unit, turn_key

__all__ = ["SessionInput", "SubmitResult", "UnknownToolCall", "enqueue_turn", "input_messages"]

# Built once (see services/session/repository.py on prepared statements).
_INSERT_TURN = insert(cast(Table, TurnRow.__table__))


class UnknownToolCall(InvalidArgument):
    """A tool result for a call that is not (yet) registered. The gateway
    renders it with code ``invalid_request_error``: the SDK's tool dispatcher
    retries on exactly that code plus the message ``Unknown pending tool call:
    <call_id>`` (openai/lib/streaming/agents/_tools.py)."""

    reason = "UNKNOWN_TOOL_CALL"


@dataclass
class SubmitResult:
    turn_ids: list[str]
    sequence: int



def input_messages(messages: Any) -> list[list[dict[str, Any]]]:
    """Typed user messages as the stored lists of content parts."""
    out: list[list[dict[str, Any]]] = []
    for message in messages:
        parts: list[dict[str, Any]] = []
        for part in message.content:
            if part.WhichOneof("content") == "image_url":
                parts.append({"type": "input_image", "image_url": part.image_url})
            else:
                parts.append({"type": "input_text", "text": part.text})
        out.append(parts)
    return out



def _user_parts(message: session_service_pb2.InputMessage, param: str) -> list[dict[str, Any]]:
    """A user message's content as stored parts. ``ContentPart`` also has the
    model's ``output_text``, which a user message must not carry."""
    parts = [to_wire(part) for part in message.content]
    if not parts:
        raise InvalidArgument(f"{param} must not be empty", param=param)
    for j, part in enumerate(parts):
        if part.get("type") not in ("input_text", "input_image"):
            raise InvalidArgument(f"{param}[{j}] must be an input_text or input_image part", param=f"{param}[{j}]")
    return parts


async def enqueue_turn(u: Unit, row: SessionRow, messages: list[list[dict[str, Any]]]) -> str:
    """Queues a turn; it runs after the active one (FIFO). Its user messages
    become items when it starts, so history stays in conversation order."""
    now = time.time()
    values: dict[str, Any] = {
        "id": new_id("turn"),
        "session_id": row.id,
        "org_id": row.org_id,
        "agent_id": row.agent_id,
        "status": TurnStatus.QUEUED,
        "created_at": now,
        "started_at": None,
        "completed_at": None,
        "error_code": "",
        "error_message": "",
        "usage_json": "",
        "cancel_requested": False,
        "worker_id": "",
        "lease_expires_at": 0.0,
        "input_json": json.dumps(messages),
        "next_output_index": 0,
        "subagent_id": row.subagent_id,
        # A turn a subagent tool call queues continues that call's trace.
        "trace_link_json": link.to_json() if row.subagent_id is not None and (link := current_link()) is not None else "",
    }
    # A Core insert: the ORM's unit of work costs more than the statement.
    await u.session.execute(_INSERT_TURN, values)
    turn = TurnRow(**values)
    await u.emit(row.id, wire.turn_event("agent.session.turn.created", views.turn_json(turn)), touch={"last_active_at": now})
    return turn.id


class SessionInput:
    def __init__(self, store: Store, runner: TurnRunner, prices: PriceTable | None = None) -> None:
        self.store = store
        self.runner = runner
        self.prices = prices or PriceTable()

    async def submit_events(
        self, org: str, session_id: str, events: Sequence[session_service_pb2.InputEvent]
    ) -> SubmitResult:
        """Applies the events in order, in one transaction. Their shapes were
        validated where the body was parsed (the gateway); this checks what
        only the session knows: its state and its pending calls."""
        if not events:
            raise InvalidArgument("events must not be empty", param="events")
        turn_ids: list[str] = []
        kick = False
        cancel: list[str] = []

        started: ClaimedTurn | None = None

        async def apply(u: Unit) -> int:
            nonlocal kick, started
            row = await repo.get_session(u.session, org, session_id)
            for i, event in enumerate(events):
                p = f"events[{i}]"
                kind = event.WhichOneof("payload")
                if kind == "message":
                    messages = [_user_parts(m, f"{p}.input[{j}].content") for j, m in enumerate(event.message.input)]
                    if not messages:
                        raise InvalidArgument(f"{p}.input must not be empty", param=f"{p}.input")
                    await refuse_input_past_limit(u.session, row, self.prices)
                    turn_ids.append(await enqueue_turn(u, row, messages))
                    kick = True
                elif kind == "cancel":
                    turn_id = await self._request_cancel(u, row)
                    if turn_id:
                        turn_ids.append(turn_id)
                        cancel.append(turn_id)
                elif kind == "tool_result":
                    turn_ids.append(await self._answer_call(u, row, event.tool_result, p))
                else:
                    raise InvalidArgument(f"{p} has no payload", param=f"{p}.type")
            # The loaded row follows the counter updates of this transaction.
            sequence = row.event_seq
            if kick and row.active_turn_id is None:
                # An idle session starts its turn in this same transaction.
                started = await self.runner.start_in(u, org, session_id)
            return sequence

        sequence = await self.store.transact(apply)
        for turn_id in cancel:
            self.runner.cancel_local(turn_id)
        if started is not None:
            self.runner.run_started(started)
        elif kick:
            self.runner.kick(session_id, org)
        return SubmitResult(list(dict.fromkeys(turn_ids)), sequence)

    async def _request_cancel(self, u: Unit, row: SessionRow) -> str:
        """Cancels the session's active turn; queued turns stay queued and run
        next (the SDK documents input.cancel as cancelling the active turn).
        Without an active turn this is a no-op."""
        turn_id = row.active_turn_id
        if turn_id is None:
            return ""
        await u.session.execute(
            update(TurnRow)
            .where(TurnRow.id == turn_id, TurnRow.status.in_(RUNNING_TURN_STATUSES))
            .values(cancel_requested=True)
        )
        # The turn's watcher, on whichever replica runs it, looks at once.
        u.wake_key(turn_key(turn_id))
        return turn_id

    async def _answer_call(
        self, u: Unit, row: SessionRow, event: session_service_pb2.InputToolResultEvent, p: str
    ) -> str:
        call_id = event.call_id
        turn_id: str = event.turn_id
        success = event.success
        # A turn of another session (or organization) reads like a missing
        # one, as it does in a path: 404, never a hint that it exists.
        turn_exists = (
            await u.session.execute(select(TurnRow.id).where(TurnRow.id == turn_id, TurnRow.session_id == row.id))
        ).scalar_one_or_none()
        if turn_exists is None:
            raise NotFound(f"turn {turn_id} not found", param=f"{p}.turn_id")
        call = (
            await u.session.execute(
                select(FunctionCallRow).where(FunctionCallRow.call_id == call_id, FunctionCallRow.session_id == row.id)
            )
        ).scalar_one_or_none()
        if call is None:
            # The SDK's helpers match this exact message for their retry.
            raise UnknownToolCall(f"Unknown pending tool call: {call_id}", param=f"{p}.call_id")
        if call.turn_id != turn_id:
            raise InvalidArgument(f"call {call_id} does not belong to turn {turn_id}", param=f"{p}.turn_id")
        if call.state == "cancelled":
            raise FailedPrecondition(f"turn {turn_id} is no longer waiting for call {call_id}", param=f"{p}.call_id")
        if call.state != "pending":
            raise Conflict(f"call {call_id} was already answered", param=f"{p}.call_id")
        output = from_value(event.output) if event.HasField("output") else None
        error = event.error if event.HasField("error") else None
        result = await u.session.execute(
            update(FunctionCallRow)
            .where(FunctionCallRow.call_id == call_id, FunctionCallRow.state == "pending")
            .values(
                state="answered",
                success=success,
                output_json=json.dumps(output if success else None),
                error=None if success else (error or "the function call failed"),
            )
        )
        if not result.rowcount:  # type: ignore[attr-defined]
            raise Conflict(f"call {call_id} was already answered", param=f"{p}.call_id")
        u.wake_key(f"calls:{turn_id}")
        return turn_id
