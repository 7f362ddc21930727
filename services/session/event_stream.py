"""A session's event log as a stream: the persisted backlog, then live
events when following, with keep-alives when idle."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from services.core.errors import InvalidArgument
from services.core.events import wait_set
from services.session import repository as repo
from services.session.models import EventRow, SessionRow
from services.session.states import SessionStatus
from services.session.store import Store

__all__ = ["EventStream"]


class EventStream:
    """``poll_s`` is how often a follower re-reads the log when commits of
    other replicas are not heard (SQLite); with a listening notifier it
    reads only when woken, and as a safety net (``Notifier.poll_s``)."""

    def __init__(self, store: Store, *, poll_s: float = 0.2) -> None:
        self.store = store
        self.poll_s = poll_s

    async def stream_events(
        self, org: str, session_id: str, after_sequence: int, *, follow: bool, keepalive_ms: int
    ) -> AsyncIterator[list[tuple[int, str, str]] | int]:
        """Yields batches of (sequence, type, event_json) for persisted events
        after the sequence, then live ones when following, and the current
        Unix time in milliseconds as a keep-alive when idle. A batch is what
        was available at once (one read of the log, or one commit's events),
        so a consumer pays per batch rather than per event. Ends when the
        session is deleted."""
        if after_sequence < 0:
            raise InvalidArgument("after_sequence must not be negative", param="after_sequence")
        if keepalive_ms < 0:
            raise InvalidArgument("keepalive_ms must not be negative", param="keepalive_ms")
        await self.store.query(lambda s: repo.get_session(s, org, session_id))
        return self._follow(session_id, org, after_sequence, follow, keepalive_ms)

    async def _follow(
        self, session_id: str, org: str, last: int, follow: bool, keepalive_ms: int
    ) -> AsyncIterator[list[tuple[int, str, str]] | int]:
        feed = self.store.feeds.subscribe(session_id)
        wake = feed.wake
        keepalive_s = keepalive_ms / 1000.0
        idle_since = time.monotonic()

        async def fetch(s: AsyncSession) -> tuple[list[EventRow], bool]:
            rows = await repo.events_after(s, session_id, last)
            if rows:
                return rows, True
            alive = (
                await s.execute(
                    select(SessionRow.id).where(
                        SessionRow.id == session_id, SessionRow.org_id == org, SessionRow.status != SessionStatus.DELETING
                    )
                )
            ).scalar_one_or_none()
            return rows, alive is not None

        try:
            fresh = True
            # Whether the wait ended with a wake-up (or the log must be read
            # again at once) rather than a time-out.
            woken = True
            next_read = 0.0
            while True:
                # A wake-up while a keep-alive was being sent counts too.
                woken = woken or wake.is_set()
                wake.clear()
                # Events committed in this process arrive through the feed;
                # the log is read first, on gaps, when the notifier woke the
                # feed (a commit heard from another replica, a deletion, a
                # resync), and when the safety-net poll is due. A keep-alive
                # alone reads nothing.
                heard = feed.take_heard()
                fed = [] if fresh else feed.take_after(last)
                fresh = False
                if fed:
                    last = fed[-1].sequence
                    yield [(e.sequence, e.type, e.event_json) for e in fed]
                    idle_since = time.monotonic()
                    if not follow or heard:
                        woken = True
                        continue
                elif woken or time.monotonic() >= next_read:
                    next_read = time.monotonic() + self.store.notifier.poll_s(self.poll_s)
                    rows, alive = await self.store.query(fetch)
                    if rows:
                        last = rows[-1].seq
                        yield [(r.seq, r.type, r.event_json) for r in rows]
                        idle_since = time.monotonic()
                        if not follow or len(rows) >= repo.EVENTS_BATCH:
                            woken = True
                            continue
                        # A short batch is all there was when it was read: wait
                        # for the next wake-up (already set if something
                        # committed meanwhile) instead of reading an empty batch.
                    elif not follow or not alive:
                        return
                timeout = max(0.0, next_read - time.monotonic())
                if keepalive_s > 0:
                    timeout = max(0.0, min(timeout, idle_since + keepalive_s - time.monotonic()))
                woken = await wait_set(wake, timeout)
                if keepalive_s > 0 and time.monotonic() - idle_since >= keepalive_s:
                    idle_since = time.monotonic()
                    yield int(time.time() * 1000)
        finally:
            self.store.feeds.unsubscribe(session_id, feed)
