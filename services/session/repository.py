"""Queries over the Session service's tables. Functions take an open
``AsyncSession`` and never commit; state changes are compare-and-set."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from sqlalchemy import String, Table, bindparam, case, delete, exists, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from services.core.db import set_clause, set_params
from services.core.errors import InvalidArgument, NotFound
from services.session.models import (
    AgentRow,
    AutomationRow,
    InvocationRow,
    ArtifactRow,
    EventRow,
    FunctionCallRow,
    ItemRow,
    PublishedOutputRow,
    SessionMetadataRow,
    SessionRow,
    SubagentRow,
    TraceRow,
    TurnRow,
    WebhookDeliveryRow,
    WebhookEndpointRow,
)
from services.session.states import SessionStatus, TurnStatus

__all__ = [
    "Page",
    "paginate",
    "replace_session_metadata",
    "metadata_filter",
    "get_agent",
    "get_session",
    "get_turn",
    "get_artifact",
    "required_actions",
    "queued_turn",
    "events_after",
    "delete_session_rows",
    "descendant_sessions",
]

Row = TypeVar(
    "Row",
    AgentRow,
    SessionRow,
    TurnRow,
    ItemRow,
    ArtifactRow,
    SubagentRow,
    WebhookEndpointRow,
    WebhookDeliveryRow,
    AutomationRow,
    InvocationRow,
    TraceRow,
)

# Core tables for the statements on a turn's path.
_SESSIONS = cast(Table, SessionRow.__table__)
_TURNS = cast(Table, TurnRow.__table__)

# Statements on a turn's path are built once, with bound parameters:
# building one (and computing its cache key) costs several times more CPU
# than executing it on SQLite. Builders keyed by the shape of a statement
# (which columns it sets, which statuses it expects) are memoized.
_GET_SESSION = select(SessionRow).where(
    SessionRow.id == bindparam("session_id"),
    SessionRow.org_id == bindparam("org_id"),
    SessionRow.status != SessionStatus.DELETING,
)
_QUEUED_TURN = (
    select(_TURNS)
    .where(_TURNS.c.session_id == bindparam("session_id"), _TURNS.c.status == TurnStatus.QUEUED)
    .order_by(_TURNS.c.pk)
    .limit(1)
)
_CLAIM_ACTIVE_TURN = (
    update(_SESSIONS)
    .where(
        _SESSIONS.c.id == bindparam("session_id"),
        _SESSIONS.c.active_turn_id.is_(None),
        _SESSIONS.c.status.not_in((SessionStatus.DELETING, SessionStatus.BUDGET_REACHED)),
    )
    .values(
        active_turn_id=bindparam("v_turn_id"),
        status=SessionStatus.IN_PROGRESS,
        last_active_at=bindparam("v_now"),
        event_seq=_SESSIONS.c.event_seq + bindparam("v_events"),
    )
    .returning(*_SESSIONS.c)
)


@functools.cache
def _update_turn(keys: tuple[str, ...], expected: tuple[str, ...], returning: bool) -> Any:
    stmt = (
        update(_TURNS)
        .where(_TURNS.c.id == bindparam("turn_id"), _TURNS.c.status.in_(expected))
        .values(set_clause(keys))
    )
    return stmt.returning(*_TURNS.c) if returning else stmt


@functools.cache
def _release_active_turn(with_usage: bool) -> Any:
    values: dict[str, Any] = {
        "active_turn_id": None,
        "status": case((_SESSIONS.c.error != "", SessionStatus.FAILED.value), else_=bindparam("v_released_status", type_=String())),
        "last_active_at": bindparam("v_now"),
        "event_seq": _SESSIONS.c.event_seq + bindparam("v_events"),
    }
    if with_usage:
        values["usage_json"] = bindparam("v_usage_json")
    queued = exists().where(_TURNS.c.session_id == bindparam("session_id"), _TURNS.c.status == TurnStatus.QUEUED)
    return (
        update(_SESSIONS)
        .where(_SESSIONS.c.id == bindparam("session_id"), _SESSIONS.c.active_turn_id == bindparam("turn_id"))
        .values(**values)
        .returning(*_SESSIONS.c, queued.label("queued"))
    )


@dataclass(frozen=True)
class Page:
    limit: int = 0
    after: str = ""
    before: str = ""
    order: str = ""


async def _cursor_pk(s: AsyncSession, model: type[Row], scope: list[Any], cursor: str, param: str) -> int:
    pk = (await s.execute(select(model.pk).where(model.id == cursor, *scope))).scalar_one_or_none()
    if pk is None:
        raise InvalidArgument(f"{param} {cursor!r} does not name a result of this list", param=param)
    return int(pk)


async def paginate(s: AsyncSession, model: type[Row], scope: list[Any], page: Page) -> tuple[list[Row], bool]:
    """Cursor pagination in creation order (default ``desc``)."""
    limit = page.limit or 20
    if not 1 <= limit <= 100:
        raise InvalidArgument("limit must be between 1 and 100", param="limit")
    order = page.order or "desc"
    if order not in ("asc", "desc"):
        raise InvalidArgument("order must be 'asc' or 'desc'", param="order")
    ascending = order == "asc"
    stmt = select(model).where(*scope)
    if page.after:
        pk = await _cursor_pk(s, model, scope, page.after, "after")
        stmt = stmt.where(model.pk > pk if ascending else model.pk < pk)
    reverse = False
    if page.before:
        pk = await _cursor_pk(s, model, scope, page.before, "before")
        stmt = stmt.where(model.pk < pk if ascending else model.pk > pk)
        # The page nearest the cursor: walk away from it, then flip back.
        reverse = not page.after
    walk_ascending = ascending != reverse
    stmt = stmt.order_by(model.pk.asc() if walk_ascending else model.pk.desc()).limit(limit + 1)
    rows: list[Row] = list((await s.execute(stmt)).scalars())
    has_more = len(rows) > limit
    rows = rows[:limit]
    if reverse:
        rows.reverse()
    return rows, has_more


async def get_agent(s: AsyncSession, org_id: str, agent_id: str) -> AgentRow:
    row = (await s.execute(select(AgentRow).where(AgentRow.id == agent_id, AgentRow.org_id == org_id))).scalar_one_or_none()
    if row is None:
        raise NotFound(f"agent {agent_id} not found", param="agent_id")
    return row


async def get_session(s: AsyncSession, org_id: str, session_id: str) -> SessionRow:
    row = (await s.execute(_GET_SESSION, {"session_id": session_id, "org_id": org_id})).scalar_one_or_none()
    if row is None:
        raise NotFound(f"session {session_id} not found", param="session_id")
    return row


async def get_turn(s: AsyncSession, session_id: str, turn_id: str) -> TurnRow:
    row = (
        await s.execute(select(TurnRow).where(TurnRow.id == turn_id, TurnRow.session_id == session_id))
    ).scalar_one_or_none()
    if row is None:
        raise NotFound(f"turn {turn_id} not found", param="turn_id")
    return row


async def get_artifact(s: AsyncSession, session_id: str, artifact_id: str) -> ArtifactRow:
    row = (
        await s.execute(select(ArtifactRow).where(ArtifactRow.id == artifact_id, ArtifactRow.session_id == session_id))
    ).scalar_one_or_none()
    if row is None:
        raise NotFound(f"artifact {artifact_id} not found", param="artifact_id")
    return row


async def required_actions(s: AsyncSession, session_id: str) -> list[dict[str, Any]]:
    rows = (
        await s.execute(
            select(FunctionCallRow)
            .where(FunctionCallRow.session_id == session_id, FunctionCallRow.state == "pending")
            .order_by(FunctionCallRow.created_at, FunctionCallRow.call_id)
        )
    ).scalars()
    return [
        {"type": "function_call", "call_id": r.call_id, "name": r.name, "arguments": r.arguments, "turn_id": r.turn_id}
        for r in rows
    ]


EVENTS_BATCH = 500


async def events_after(s: AsyncSession, session_id: str, after: int, limit: int = EVENTS_BATCH) -> list[EventRow]:
    return list(
        (
            await s.execute(
                select(EventRow)
                .where(EventRow.session_id == session_id, EventRow.seq > after)
                .order_by(EventRow.seq)
                .limit(limit)
            )
        ).scalars()
    )


async def queued_turn(s: AsyncSession, session_id: str) -> TurnRow | None:
    """The session's oldest queued turn. Like the rows the turn-path
    functions below return, it is built from a Core statement's result and
    not tracked by the ORM session (the ORM's bookkeeping costs more CPU than
    these statements)."""
    row = (await s.execute(_QUEUED_TURN, {"session_id": session_id})).one_or_none()
    return TurnRow(**row._mapping) if row is not None else None


async def claim_active_turn(s: AsyncSession, session_id: str, turn_id: str, now: float, *, events: int = 0) -> SessionRow | None:
    """The per-session mutex: at most one turn holds ``active_turn_id``.
    Returns the claimed session row (untracked), with ``events`` sequence
    numbers allocated up to its ``event_seq`` (for ``Unit.append``)."""
    result = await s.execute(
        _CLAIM_ACTIVE_TURN, {"session_id": session_id, "v_turn_id": turn_id, "v_now": now, "v_events": events}
    )
    row = result.one_or_none()
    return SessionRow(**row._mapping) if row is not None else None


async def set_turn_status(s: AsyncSession, turn_id: str, expected: tuple[str, ...], **values: Any) -> bool:
    stmt = _update_turn(tuple(values), tuple(expected), False)
    result = await s.execute(stmt, {"turn_id": turn_id, **set_params(values)})
    return bool(result.rowcount)  # type: ignore[attr-defined]


async def transition_turn(s: AsyncSession, turn_id: str, expected: tuple[str, ...], **values: Any) -> TurnRow | None:
    """``set_turn_status`` that returns the updated turn (untracked)."""
    stmt = _update_turn(tuple(values), tuple(expected), True)
    row = (await s.execute(stmt, {"turn_id": turn_id, **set_params(values)})).one_or_none()
    return TurnRow(**row._mapping) if row is not None else None


async def release_active_turn(
    s: AsyncSession,
    session_id: str,
    turn_id: str,
    now: float,
    *,
    events: int,
    usage_json: str | None,
    budget_reached: bool = False,
) -> tuple[SessionRow, bool] | None:
    """Releases the per-session mutex held by ``turn_id``: the session goes
    idle (``budget_reached`` when the turn reached the spend limit), or failed
    when its environment setup failed. Allocates ``events`` sequence numbers
    up to the returned row's ``event_seq``. Returns the updated session
    (untracked) and whether another turn is queued; None when the turn did
    not hold the mutex."""
    released = SessionStatus.BUDGET_REACHED if budget_reached else SessionStatus.IDLE
    params: dict[str, Any] = {
        "session_id": session_id,
        "turn_id": turn_id,
        "v_now": now,
        "v_events": events,
        "v_released_status": released.value,
    }
    if usage_json is not None:
        params["v_usage_json"] = usage_json
    result = await s.execute(_release_active_turn(usage_json is not None), params)
    row = result.one_or_none()
    if row is None:
        return None
    columns = dict(row._mapping)
    # A session paused at its budget starts no queued turn until it resumes.
    more = bool(columns.pop("queued")) and not budget_reached
    return SessionRow(**columns), more


async def move_idle_session(s: AsyncSession, session_id: str, expected: str, status: str) -> bool:
    """Moves a session that no turn holds from ``expected`` to ``status``
    (its budget pause and resume); False when a turn took it meanwhile or
    its status changed. The loaded ORM row is left as it was read."""
    result = await s.execute(
        update(_SESSIONS)
        .where(_SESSIONS.c.id == session_id, _SESSIONS.c.active_turn_id.is_(None), _SESSIONS.c.status == expected)
        .values(status=status)
    )
    return bool(result.rowcount)  # type: ignore[attr-defined]


async def has_queued_turn(s: AsyncSession, session_id: str) -> bool:
    found = await s.execute(select(TurnRow.pk).where(TurnRow.session_id == session_id, TurnRow.status == TurnStatus.QUEUED).limit(1))
    return found.first() is not None


async def replace_session_metadata(s: AsyncSession, org_id: str, session_id: str, metadata: dict[str, str]) -> None:
    """The session's filterable metadata pairs become ``metadata``."""
    await s.execute(delete(SessionMetadataRow).where(SessionMetadataRow.session_id == session_id))
    s.add_all(
        SessionMetadataRow(session_id=session_id, key=k, org_id=org_id, value=v) for k, v in sorted(metadata.items())
    )


def metadata_filter(org_id: str, metadata: dict[str, str]) -> list[Any]:
    """Conditions on SessionRow: every pair of ``metadata`` matches exactly."""
    return [
        SessionRow.id.in_(
            select(SessionMetadataRow.session_id).where(
                SessionMetadataRow.org_id == org_id, SessionMetadataRow.key == k, SessionMetadataRow.value == v
            )
        )
        for k, v in sorted(metadata.items())
    ]


async def delete_session_rows(s: AsyncSession, session_id: str) -> list[str]:
    """Deletes everything a session owns; returns the artifact blob hashes it referenced."""
    shas = [
        str(sha)
        for sha in (await s.execute(select(ArtifactRow.sha256).where(ArtifactRow.session_id == session_id).distinct())).scalars()
    ]
    for model in (ArtifactRow, PublishedOutputRow, EventRow, FunctionCallRow, ItemRow, TurnRow, SessionMetadataRow, TraceRow):
        await s.execute(delete(model).where(model.session_id == session_id))
    await s.execute(delete(SubagentRow).where(SubagentRow.child_session_id == session_id))
    await s.execute(delete(SessionRow).where(SessionRow.id == session_id))
    return shas


async def descendant_sessions(s: AsyncSession, session_id: str) -> list[str]:
    """The child sessions of the session's subagents, theirs, and so on,
    parents before children."""
    out: list[str] = []
    frontier = [session_id]
    while frontier:
        found = (
            await s.execute(
                select(SubagentRow.child_session_id).where(SubagentRow.parent_session_id.in_(frontier)).order_by(SubagentRow.pk)
            )
        ).scalars()
        frontier = [str(c) for c in found]
        out.extend(frontier)
    return out


async def unreferenced_blobs(s: AsyncSession, shas: list[str]) -> list[str]:
    if not shas:
        return []
    referenced = set(
        (await s.execute(select(ArtifactRow.sha256).where(ArtifactRow.sha256.in_(shas)).group_by(ArtifactRow.sha256))).scalars()
    )
    return [sha for sha in shas if sha not in referenced]


__all__ += [
    "claim_active_turn",
    "set_turn_status",
    "transition_turn",
    "release_active_turn",
    "move_idle_session",
    "has_queued_turn",
    "unreferenced_blobs",
    "EVENTS_BATCH",
]
