"""Queries on the Sandbox service's table.

Functions take an ``AsyncSession`` and never commit; the caller owns the
transaction. A state change is a compare-and-set (``UPDATE ... WHERE state``
is one the caller expects, then check the row count), which behaves the same
on SQLite and PostgreSQL; a transition whose expected state no longer holds
raises ``IllegalTransition``. Listings page in SQL: labels are matched in
the query and a page is at most ``page_size + 1`` rows after the keyset
cursor (the last sandbox ID of the previous page).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, NamedTuple, cast

from sqlalchemy import JSON, ColumnElement, and_, func, literal, select, update
from sqlalchemy import cast as sql_cast
from sqlalchemy.engine import CursorResult
from sqlalchemy.ext.asyncio import AsyncSession

from services.core.errors import FailedPrecondition
from services.sandbox.models import SandboxRow

__all__ = [
    "IllegalTransition",
    "Page",
    "get_sandbox",
    "insert_sandbox",
    "unsettled_sandboxes",
    "transition",
    "count_by_state",
    "count_in_states",
    "list_labeled_sandboxes",
]


class IllegalTransition(FailedPrecondition):
    """The sandbox is not in a state the transition starts from: another
    operation changed it first, or it was destroyed."""


class Page(NamedTuple):
    rows: list[SandboxRow]
    # The cursor of the next page; empty on the last page.
    next_page_token: str


async def get_sandbox(session: AsyncSession, sandbox_id: str) -> SandboxRow | None:
    """The sandbox's row, destroyed or not, of any organization."""
    return await session.get(SandboxRow, sandbox_id)


def insert_sandbox(session: AsyncSession, row: SandboxRow) -> None:
    session.add(row)


async def unsettled_sandboxes(session: AsyncSession, states: Collection[str]) -> Sequence[SandboxRow]:
    """The sandboxes in one of ``states``: those a restarted service adopts."""
    found = await session.execute(select(SandboxRow).where(SandboxRow.state.in_(tuple(states))))
    return found.scalars().all()


async def transition(
    session: AsyncSession,
    sandbox_id: str,
    expected: Collection[str],
    state: str,
    *,
    now: float | None,
    error: str = "",
    handle_json: str | None = None,
) -> None:
    """Moves the sandbox from one of the ``expected`` states to ``state``,
    recording ``error`` (cleared by default) and, unless ``now`` is None, the
    activity time."""
    values: dict[str, Any] = {"state": state, "error": error}
    if now is not None:
        values["last_active_at"] = now
    if handle_json is not None:
        values["handle_json"] = handle_json
    result = await session.execute(
        update(SandboxRow)
        .where(SandboxRow.sandbox_id == sandbox_id, SandboxRow.state.in_(tuple(expected)))
        .values(**values)
    )
    if int(cast(CursorResult[Any], result).rowcount) != 1:
        raise IllegalTransition(f"sandbox {sandbox_id} is no longer in state {' or '.join(sorted(expected))}")


async def count_by_state(session: AsyncSession) -> dict[str, int]:
    grouped = await session.execute(select(SandboxRow.state, func.count()).group_by(SandboxRow.state))
    return {str(state): int(count) for state, count in grouped.all()}


async def count_in_states(session: AsyncSession, states: Collection[str]) -> int:
    stmt = select(func.count()).select_from(SandboxRow).where(SandboxRow.state.in_(tuple(states)))
    return int((await session.execute(stmt)).scalar_one())


async def list_labeled_sandboxes(
    session: AsyncSession, label_key: str, *, exclude_state: str, page_size: int, page_token: str
) -> Page:
    """Sandboxes of every organization not in ``exclude_state`` that carry
    the label ``label_key``, by ID."""
    return await _page(
        session,
        and_(SandboxRow.state != exclude_state, _has_label(session, label_key)),
        page_size=page_size,
        page_token=page_token,
    )


async def _page(session: AsyncSession, where: ColumnElement[bool], *, page_size: int, page_token: str) -> Page:
    stmt = select(SandboxRow).where(where)
    if page_token:
        stmt = stmt.where(SandboxRow.sandbox_id > page_token)
    # One row more than the page tells whether another page follows.
    stmt = stmt.order_by(SandboxRow.sandbox_id).limit(page_size + 1)
    rows = list((await session.execute(stmt)).scalars())
    if len(rows) <= page_size:
        return Page(rows, "")
    page = rows[:page_size]
    return Page(page, page[-1].sandbox_id)


def _has_label(session: AsyncSession, key: str) -> ColumnElement[bool]:
    """Whether the row's labels (a JSON object of strings) hold ``key``.
    Keys are bound parameters, never part of a JSON path, so any key matches
    exactly."""
    if session.get_bind().dialect.name == "postgresql":
        each = func.json_each_text(sql_cast(SandboxRow.labels_json, JSON))
    else:
        each = func.json_each(SandboxRow.labels_json)
    label = each.table_valued("key", "value").alias("label")
    return select(literal(1)).select_from(label).where(label.c.key == key).exists()
