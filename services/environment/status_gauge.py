"""Keeps the ``berth_environments{status}`` gauge current.

The counts come from the database, so every replica reports the same
totals (aggregate them with ``max``, not ``sum``). One grouped count runs
shortly after a transition this process made, coalescing bursts into one
query at most every ``min_interval_s``, and every ``interval_s`` regardless,
which picks up transitions made by other replicas. Requests never wait on it.
"""

from __future__ import annotations

import asyncio
import contextlib

from services.core.db import Database
from services.core.logging import get_logger
from services.core.metrics import ENVIRONMENTS
from services.environment import repository as repo
from services.environment.states import EnvironmentStatus

__all__ = ["EnvironmentStatusGauge"]

log = get_logger(__name__)

class EnvironmentStatusGauge:
    def __init__(self, db: Database, *, interval_s: float = 15.0, min_interval_s: float = 0.5) -> None:
        self._db = db
        self._interval_s = interval_s
        self._min_interval_s = min_interval_s
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="environment-status-gauge")

    def touch(self) -> None:
        """Notes that an environment changed status (cheap; never blocks)."""
        self._changed.set()

    async def refresh(self) -> None:
        async with self._db.transaction(read_only=True) as s:
            counts = await repo.count_environments_by_status(s)
        for status in EnvironmentStatus:
            ENVIRONMENTS.labels(status=status).set(counts.get(status, 0))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            self._changed.clear()
            try:
                await self.refresh()
            except Exception:
                log.warning("environment_gauge_refresh_failed", exc_info=True)
            await asyncio.sleep(self._min_interval_s)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._interval_s):
                    await self._changed.wait()
