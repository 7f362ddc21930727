"""What the Session service's units of work write: a turn's trace and the event counter, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
from typing import Any, cast

from sqlalchemy import select

from services.session.harness.trace import TurnTrace
from services.session.models import TraceRow, TurnRow
from services.session.store import Store
from services.session.traces import TraceStore
from db_support import service_database


def _turn() -> TurnRow:
    return TurnRow(id="turn_trace1", session_id="sess_trace1", org_id="org_trace", created_at=1.0)


def _trace(name: str) -> TurnTrace:
    trace = TurnTrace(session_id="sess_trace1", turn_id="turn_trace1")
    with trace.span("tool", name):
        pass
    trace.end("completed")
    return trace


def _span_names(row: TraceRow) -> list[str]:
    spans = json.loads(row.otlp_json)["resourceSpans"][0]["scopeSpans"][0]["spans"]
    return sorted(span["name"] for span in spans)


async def test_a_resumed_turns_trace_replaces_the_one_its_previous_worker_stored(database_url: str) -> None:
    async with service_database(database_url, "session") as db:
        traces = TraceStore(Store(db))
        first, second = _trace("first_worker"), _trace("second_worker")
        await traces.store.transact(lambda u: traces.record(u, _turn(), first))
        await traces.store.transact(lambda u: traces.record(u, _turn(), second))

        rows = (await traces.store.query(lambda s: s.execute(select(TraceRow)))).scalars().all()

        assert [(r.id, r.org_id, r.session_id, r.root_turn_id) for r in rows] == [
            ("turn_trace1", "org_trace", "sess_trace1", None)
        ]
        assert "second_worker" in _span_names(rows[0])
        assert "first_worker" not in _span_names(rows[0])


async def test_an_emit_hands_the_new_counter_and_touched_values_to_the_session_row_its_unit_loaded(
    database_url: str,
) -> None:
    from sqlalchemy import Table, insert

    from services.session.models import SessionRow

    table = cast(Table, SessionRow.__table__)
    values: dict[str, object] = {}
    for column in table.columns:
        if column.name == "pk" or column.nullable or column.default is not None or column.server_default is not None:
            continue
        values[column.name] = 0 if column.type.python_type in (int, float, bool) else ""
    values.update(id="sess_emit1", org_id="org_emit", event_seq=5, last_active_at=1.0)
    async with service_database(database_url, "session") as db:
        store = Store(db)
        async with db.transaction() as s:
            await s.execute(insert(table), [values])

        async def emit(u: Any) -> tuple[int, float, int]:
            row = (await u.session.execute(select(SessionRow).where(SessionRow.id == "sess_emit1"))).scalar_one()
            appended = await u.emit("sess_emit1", {"type": "a"}, {"type": "b"}, touch={"last_active_at": 42.0})
            return row.event_seq, row.last_active_at, appended[-1].sequence

        seen_seq, seen_active, last = await store.transact(emit)
        stored = (await store.query(lambda s: s.execute(select(SessionRow).where(SessionRow.id == "sess_emit1")))).scalar_one()

        assert (seen_seq, seen_active, last) == (7, 42.0, 7)
        assert (stored.event_seq, stored.last_active_at) == (7, 42.0)
