"""Root-turn traces: stored with the turn's outcome, listed as the SDK's
``SessionTrace`` pages, with the spans of the subagent turns linked to each
root turn (``harness/trace.py``) published under it as they end, and, with ``BERTH_TRACE_OTLP_ENDPOINT`` set, sent to
an OpenTelemetry collector as OTLP/HTTP JSON (best effort: a collector that
is down or slow costs a log line, never the turn)."""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any, cast

import httpx
from sqlalchemy import Table, select
from sqlalchemy.ext.asyncio import AsyncSession

from services.core.db import upsert_insert
from services.core.errors import TraceTooLarge
from services.core.logging import get_logger
from services.session import repository as repo
from services.session.harness.trace import TurnTrace
from services.session.models import TraceRow, TurnRow
from services.session.repository import Page
from services.session.store import Store, Unit

__all__ = ["TraceStore", "PAGE_BYTES"]

log = get_logger(__name__)

# A page of traces stays within the API's 16 MiB response limit: it holds
# fewer traces than asked for when they would not fit, and a first trace
# that cannot fit by itself is an error. A trace is measured by its stored
# JSON (the response's compact UTF-8 is never longer) plus its fields.
PAGE_BYTES = 16 * 1024 * 1024
_PAGE_ENVELOPE_BYTES = 512
_TRACE_FIELDS_BYTES = 256


_TRACES = cast(Table, TraceRow.__table__)


@functools.cache
def _upsert_trace(dialect: str) -> Any:
    """``INSERT ... ON CONFLICT (id) DO UPDATE``: a previous worker of the
    same turn may have stored its trace. Built once per dialect (every turn
    runs it, and building costs more than running)."""
    stmt = upsert_insert(dialect, _TRACES)
    replaced = ("org_id", "session_id", "created_at", "otlp_json", "root_turn_id")
    return stmt.on_conflict_do_update(index_elements=[_TRACES.c.id], set_={c: stmt.excluded[c] for c in replaced})


def _with_linked(root: TraceRow, linked: list[TraceRow]) -> TraceRow:
    """``root`` (untracked) with the spans of ``linked`` appended to its own."""
    if not linked:
        return root
    otlp = json.loads(root.otlp_json)
    spans = otlp["resourceSpans"][0]["scopeSpans"][0]["spans"]
    for row in linked:
        for resource in json.loads(row.otlp_json)["resourceSpans"]:
            for scope in resource["scopeSpans"]:
                spans.extend(scope["spans"])
    return TraceRow(
        id=root.id,
        org_id=root.org_id,
        session_id=root.session_id,
        created_at=root.created_at,
        otlp_json=json.dumps(otlp, separators=(",", ":")),
    )


class TraceStore:
    def __init__(self, store: Store, *, otlp_endpoint: str = "", export_timeout_s: float = 10.0) -> None:
        self.store = store
        self.otlp_endpoint = otlp_endpoint
        self._client = httpx.AsyncClient(timeout=export_timeout_s) if otlp_endpoint else None
        self._exports: set[asyncio.Task[None]] = set()

    async def record(self, u: Unit, turn: TurnRow, trace: TurnTrace) -> None:
        """Stores the turn's trace in the transaction that ends the turn
        (replacing one a previous worker of the same turn stored)."""
        await u.session.execute(
            _upsert_trace(u.session.get_bind().dialect.name),
            {
                "id": turn.id,
                "org_id": turn.org_id,
                "session_id": turn.session_id,
                "created_at": turn.created_at,
                "otlp_json": json.dumps(trace.otlp(), separators=(",", ":")),
                "root_turn_id": trace.root_turn_id if trace.link is not None else None,
            },
        )

    def export(self, turn_id: str, trace: TurnTrace) -> None:
        """Sends the trace to the collector in the background, when one is configured."""
        if self._client is None:
            return
        task = asyncio.create_task(self._export(trace.otlp(), turn_id), name=f"trace-export-{turn_id}")
        self._exports.add(task)
        task.add_done_callback(self._exports.discard)

    async def _export(self, otlp: dict[str, object], turn_id: str) -> None:
        assert self._client is not None
        try:
            response = await self._client.post(self.otlp_endpoint, json=otlp)
            if response.status_code >= 300:
                log.warning("trace_export_rejected", turn_id=turn_id, status=response.status_code)
        except httpx.HTTPError as exc:
            log.warning("trace_export_failed", turn_id=turn_id, error=type(exc).__name__)

    async def list(self, org: str, session_id: str, page: Page) -> tuple[list[TraceRow], bool]:
        """A page of the session's root-turn traces, each with the spans its
        subagent turns published so far."""

        async def run(s: AsyncSession) -> tuple[list[TraceRow], bool]:
            await repo.get_session(s, org, session_id)
            scope = [TraceRow.session_id == session_id, TraceRow.root_turn_id.is_(None)]
            roots, more = await repo.paginate(s, TraceRow, scope, page)
            linked = (
                await s.scalars(
                    select(TraceRow)
                    .where(TraceRow.org_id == org, TraceRow.root_turn_id.in_([r.id for r in roots]))
                    .order_by(TraceRow.pk)
                )
            ).all()
            traces = [_with_linked(r, [t for t in linked if t.root_turn_id == r.id]) for r in roots]
            return _fit_page(traces, more)

        return await self.store.query(run)

    async def close(self) -> None:
        if self._exports:
            await asyncio.wait(set(self._exports), timeout=5)
        if self._client is not None:
            await self._client.aclose()


def _fit_page(traces: list[TraceRow], more: bool) -> tuple[list[TraceRow], bool]:
    """The leading traces that fit in ``PAGE_BYTES``; the rest are left for
    the next page (``has_more``)."""
    used = _PAGE_ENVELOPE_BYTES
    for i, trace in enumerate(traces):
        used += len(trace.otlp_json.encode()) + _TRACE_FIELDS_BYTES
        if used > PAGE_BYTES:
            if i == 0:
                raise TraceTooLarge(f"trace {trace.id} does not fit in a 16 MiB response page by itself")
            return traces[:i], True
    return traces, more
