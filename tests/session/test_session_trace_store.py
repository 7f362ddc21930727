"""The trace a turn stores with its outcome, on SQLite and PostgreSQL."""

from __future__ import annotations

import json

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
