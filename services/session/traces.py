"""Root-turn traces: stored with the turn's outcome, listed as the SDK's
``SessionTrace`` pages, and, with ``BERTH_TRACE_OTLP_ENDPOINT`` set, sent to
an OpenTelemetry collector as OTLP/HTTP JSON (best effort: a collector that
is down or slow costs a log line, never the turn)."""

from __future__ import annotations

import asyncio
import json

import httpx
from sqlalchemy import delete
from sqlalchemy.ext.asyncio import AsyncSession

from services.core.logging import get_logger
from services.session import repository as repo
from services.session.harness.trace import TurnTrace
from services.session.models import TraceRow, TurnRow
from services.session.repository import Page
from services.session.store import Store, Unit

__all__ = ["TraceStore"]

log = get_logger(__name__)


class TraceStore:
    def __init__(self, store: Store, *, otlp_endpoint: str = "", export_timeout_s: float = 10.0) -> None:
        self.store = store
        self.otlp_endpoint = otlp_endpoint
        self._client = httpx.AsyncClient(timeout=export_timeout_s) if otlp_endpoint else None
        self._exports: set[asyncio.Task[None]] = set()

    async def record(self, u: Unit, turn: TurnRow, trace: TurnTrace) -> None:
        """Stores the turn's trace in the transaction that ends the turn
        (replacing one a previous worker of the same turn stored)."""
        await u.session.execute(delete(TraceRow).where(TraceRow.id == turn.id))
        u.session.add(
            TraceRow(
                id=turn.id,
                org_id=turn.org_id,
                session_id=turn.session_id,
                created_at=turn.created_at,
                otlp_json=json.dumps(trace.otlp(), separators=(",", ":")),
            )
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
        async def run(s: AsyncSession) -> tuple[list[TraceRow], bool]:
            await repo.get_session(s, org, session_id)
            return await repo.paginate(s, TraceRow, [TraceRow.session_id == session_id], page)

        return await self.store.query(run)

    async def close(self) -> None:
        if self._exports:
            await asyncio.wait(set(self._exports), timeout=5)
        if self._client is not None:
            await self._client.aclose()
