"""The unit of work and the per-session event log.

``Store.transact()`` runs one transaction (a ``Unit``). Events appended
inside it get their sequence numbers from the session's counter row
(``UPDATE sessions SET event_seq = event_seq + n ... RETURNING``), in the
same transaction as the rows they describe: a row lock on PostgreSQL and the
write lock on SQLite serialize writers, so numbers are gapless and commit in
order on every replica. A caller that updates the session row anyway (to
claim or release a turn) advances the counter in that same statement and
hands the numbers to ``Unit.append``. The event rows are inserted together
when the unit's work is done. After commit, the appended events are handed to local stream
followers (``EventFeed``) so they need not read back what was just written;
a follower reads the log when its feed has a gap (a commit on another
replica, or two local commits handed over out of order). Followers on other
replicas are woken by the ``Notifier`` (services/core/notify.py): the unit
announces the keys it wakes inside its transaction.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from sqlalchemy import Table, bindparam, insert, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm.attributes import set_committed_value

from services.core.db import Database, set_clause, set_params
from services.core.errors import NotFound
from services.core.ids import new_id
from services.core.notify import Notifier
from services.session.models import EventRow, SessionRow

__all__ = ["Store", "Unit", "AppendedEvent", "EventFeed", "EventFeeds", "FedEvent", "events_key", "turn_key"]

T = TypeVar("T")

# Events are inserted with Core: the ORM's unit of work costs more than the statement.
_EVENTS = cast(Table, EventRow.__table__)
# Built once (see services/session/repository.py on prepared statements).
_INSERT_EVENTS = insert(_EVENTS)


_SESSIONS = cast(Table, SessionRow.__table__)


@functools.cache
def _emit_statement(touched: tuple[str, ...]) -> Any:
    """``UPDATE sessions SET event_seq = event_seq + :n [, touched...]
    RETURNING event_seq``. A Core statement: the ORM's synchronization of
    loaded rows (``Unit._follow`` does that part) cost more than the
    statement."""
    return (
        update(_SESSIONS)
        .where(_SESSIONS.c.id == bindparam("session_id"))
        .values({"event_seq": _SESSIONS.c.event_seq + bindparam("v_count"), **set_clause(touched)})
        .returning(_SESSIONS.c.event_seq)
    )


@dataclass(frozen=True)
class FedEvent:
    """A committed event as a local follower receives it."""

    sequence: int
    type: str
    event_json: str


class EventFeed:
    """Committed events of one session handed to one local follower. Bounded:
    a follower that falls behind loses the buffer and reads the log instead."""

    LIMIT = 1000

    def __init__(self) -> None:
        self.wake = asyncio.Event()
        self._events: deque[FedEvent] = deque()
        self.overflowed = False
        # Woken by the notifier (a commit elsewhere, a deletion, a resync):
        # the log may hold what was not fed.
        self.heard = False

    def set(self) -> None:
        """A notifier wake-up (``services.core.notify.Waiter``)."""
        self.heard = True
        self.wake.set()

    def take_heard(self) -> bool:
        heard, self.heard = self.heard, False
        return heard

    def push(self, events: list[FedEvent]) -> None:
        if len(self._events) + len(events) > self.LIMIT:
            self._events.clear()
            self.overflowed = True
        else:
            self._events.extend(events)
        self.wake.set()

    def take_after(self, last: int) -> list[FedEvent]:
        """The buffered events that directly follow ``last`` without a gap,
        or nothing if there is a gap (the caller then reads the log)."""
        events = sorted((e for e in self._events if e.sequence > last), key=lambda e: e.sequence)
        self._events.clear()
        if self.overflowed:
            self.overflowed = False
            return []
        expected = last + 1
        for event in events:
            if event.sequence != expected:
                return []
            expected += 1
        return events


class EventFeeds:
    """The local followers' feeds, by session. Each feed also waits on the
    ``Notifier`` for ``events:<session_id>``, so commits heard from other
    replicas wake it too (marked ``heard``: it reads the log)."""

    def __init__(self, notifier: Notifier) -> None:
        self.notifier = notifier
        self._feeds: dict[str, set[EventFeed]] = {}

    def subscribe(self, session_id: str) -> EventFeed:
        feed = EventFeed()
        self._feeds.setdefault(session_id, set()).add(feed)
        self.notifier.add_waiter(events_key(session_id), feed)
        return feed

    def unsubscribe(self, session_id: str, feed: EventFeed) -> None:
        self.notifier.unsubscribe(events_key(session_id), feed)
        feeds = self._feeds.get(session_id)
        if feeds is not None:
            feeds.discard(feed)
            if not feeds:
                del self._feeds[session_id]

    def feed(self, session_id: str, events: list[FedEvent]) -> None:
        for feed in self._feeds.get(session_id, ()):
            feed.push(events)


def events_key(session_id: str) -> str:
    """The wake-up key of a session's event log (and of its deletion)."""
    return f"events:{session_id}"


def turn_key(turn_id: str) -> str:
    """The wake-up key of a turn's watcher: a cancel was requested."""
    return f"turn:{turn_id}"


@dataclass
class AppendedEvent:
    sequence: int
    type: str
    event: dict[str, Any]
    event_json: str = ""


@dataclass
class Unit:
    """One open transaction plus the events it appends."""

    session: AsyncSession
    appended: list[tuple[str, AppendedEvent]] = field(default_factory=list)
    # Rows of the appended events, inserted when the unit's work is done.
    event_rows: list[dict[str, Any]] = field(default_factory=list)
    wake: set[str] = field(default_factory=set)

    async def emit(
        self, session_id: str, *events: dict[str, Any], turn_id: str = "", touch: dict[str, Any] | None = None
    ) -> list[AppendedEvent]:
        """Appends events to the session's log; each gets a unique event_id.
        ``touch`` sets other columns of the session row in the same statement."""
        if not events:
            return []
        touch = touch or {}
        result = await self.session.execute(
            _emit_statement(tuple(touch)),
            {"session_id": session_id, "v_count": len(events), **set_params(touch)},
        )
        last = result.scalar_one_or_none()
        if last is None:
            raise NotFound(f"session {session_id} not found")
        self._follow(session_id, {**touch, "event_seq": int(last)})
        return self.append(session_id, int(last), *events, turn_id=turn_id)

    def _follow(self, session_id: str, values: dict[str, Any]) -> None:
        """The session's row, if this unit loaded it, takes the values just
        written (as committed state: the unit does not write them again)."""
        for loaded in list(self.session.identity_map.values()):
            if isinstance(loaded, SessionRow) and loaded.id == session_id:
                for column, value in values.items():
                    set_committed_value(loaded, column, value)

    def append(self, session_id: str, last: int, *events: dict[str, Any], turn_id: str = "") -> list[AppendedEvent]:
        """Appends events numbered up to ``last``: the caller has advanced the
        session's counter (``event_seq``) by ``len(events)`` in this
        transaction, with its own UPDATE of the session row, and read ``last``
        back. ``emit`` is that UPDATE alone."""
        if not events:
            return []
        first = last - len(events) + 1
        now = time.time()
        out: list[AppendedEvent] = []
        for offset, body in enumerate(events):
            event = {"event_id": new_id("evt"), **body}
            seq = first + offset
            event_json = json.dumps(event, separators=(",", ":"))
            self.event_rows.append(
                {
                    "session_id": session_id,
                    "seq": seq,
                    "type": str(event["type"]),
                    "turn_id": str(event.get("turn_id") or turn_id or ""),
                    "event_json": event_json,
                    "created_at": now,
                }
            )
            appended = AppendedEvent(seq, str(event["type"]), event, event_json)
            out.append(appended)
            self.appended.append((session_id, appended))
        self.wake.add(events_key(session_id))
        return out

    async def write_events(self) -> None:
        """Inserts the appended events (one statement, whatever their number)."""
        if self.event_rows:
            rows, self.event_rows = self.event_rows, []
            await self.session.execute(_INSERT_EVENTS, rows)

    def wake_key(self, key: str) -> None:
        self.wake.add(key)


class Store:
    """Runs units of work through ``Database.run``: each transaction runs to
    its end however its caller is cancelled (see services/core/db.py)."""

    def __init__(
        self, db: Database, notifier: Notifier | None = None, *, before_commit: Callable[[Unit], Awaitable[None]] | None = None
    ) -> None:
        self.db = db
        self.notifier = notifier or Notifier()
        self.feeds = EventFeeds(self.notifier)
        # Runs at the end of every unit, in its transaction (the webhook outbox).
        self.before_commit = before_commit

    async def transact(self, fn: Callable[[Unit], Awaitable[T]], *, inflight: set[asyncio.Future[Any]] | None = None) -> T:
        """One read-write transaction; events appended by ``fn`` wake local
        followers after commit, and the keys it wakes are announced to other
        replicas inside it (delivered on commit). ``inflight`` collects the
        transaction while it runs, so a cancelled caller can wait for it to
        settle."""

        async def work(session: AsyncSession) -> tuple[T, Unit]:
            unit = Unit(session)
            result = await fn(unit)
            if self.before_commit is not None:
                await self.before_commit(unit)
            await session.flush()
            await unit.write_events()
            if unit.wake:
                await self.notifier.announce(session, unit.wake)
            return result, unit

        result, _ = await self.db.run(work, inflight=inflight, after_commit=lambda done: self._publish(done[1]))
        return result

    def _publish(self, unit: Unit) -> None:
        committed: dict[str, list[FedEvent]] = {}
        for session_id, appended in unit.appended:
            committed.setdefault(session_id, []).append(FedEvent(appended.sequence, appended.type, appended.event_json))
        for session_id, events in committed.items():
            self.feeds.feed(session_id, events)
        # Followers of a session whose events were just fed need not read the log.
        fed = {events_key(session_id) for session_id in committed}
        for key in unit.wake - fed:
            self.notifier.wake(key)

    async def query(self, fn: Callable[[AsyncSession], Awaitable[T]]) -> T:
        """One read-only transaction. On SQLite it stays deferred (no write
        lock), so reads never queue behind writers in the busy handler."""
        return await self.db.run(fn, read_only=True)
