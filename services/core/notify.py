"""How waiters hear that something they wait for was committed.

A waiter (a stream following a session's events, a turn watching for a
cancel, a turn waiting for tool results) subscribes to a key such as
``events:<session_id>`` and sleeps on an ``asyncio.Event``. A unit of work
names the keys its commit concerns; after commit they are woken in this
process (``wake``), and ``announce``, called inside the transaction, tells
the other replicas.

- ``Notifier`` (SQLite, ``berth serve``) wakes this process only. Replicas
  of a service on one SQLite file find each other's commits by polling at
  the waiter's own interval (``poll_s(fallback)`` is the fallback).
- ``PostgresNotifier`` announces with ``NOTIFY`` in the writing transaction,
  so the announcement is delivered only if and when it commits. One
  long-lived asyncpg connection per process ``LISTEN``s and wakes the local
  waiters of the keys it hears. The payload is the sender's replica tag and
  the keys (IDs only). Notifications sent while the listener is down are
  lost, so on every (re)connect all waiters are woken to re-read the
  database, and while it is down they poll at their fallback interval.
  With the listener up they poll only as a slow safety net
  (``notify_safety_poll_s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Iterable
from typing import Any, Protocol

import asyncpg
from sqlalchemy import bindparam, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from services.core.db import Database
from services.core.logging import get_logger

__all__ = ["Notifier", "PostgresNotifier", "SoleWriterNotifier", "Waiter", "open_notifier"]

log = get_logger(__name__)

# Built once (see services/session/repository.py on prepared statements).
_NOTIFY = select(func.pg_notify(bindparam("channel"), bindparam("payload")))
# PostgreSQL refuses payloads of 8000 bytes or more.
_PAYLOAD_LIMIT = 7900
# Query options of a database URL that asyncpg reads as connection options.
_DSN_OPTIONS = frozenset(
    {
        "passfile", "options", "sslmode", "sslcert", "sslkey", "sslrootcert", "sslcrl", "sslpassword",
        "ssl_min_protocol_version", "ssl_max_protocol_version", "target_session_attrs", "krbsrvname", "gsslib",
    }
)


class Waiter(Protocol):
    """What a wake-up sets: an ``asyncio.Event``, or anything with ``set``."""

    def set(self) -> None: ...


class Notifier:
    """In-process wake-ups by key. Nothing crosses the process."""

    def __init__(self) -> None:
        self._waiters: dict[str, set[Waiter]] = {}

    def subscribe(self, key: str) -> asyncio.Event:
        """A new event, set when ``key`` is woken."""
        event = asyncio.Event()
        self.add_waiter(key, event)
        return event

    def add_waiter(self, key: str, waiter: Waiter) -> None:
        self._waiters.setdefault(key, set()).add(waiter)

    def unsubscribe(self, key: str, waiter: Waiter) -> None:
        waiters = self._waiters.get(key)
        if waiters is not None:
            waiters.discard(waiter)
            if not waiters:
                del self._waiters[key]

    def wake(self, key: str) -> None:
        for waiter in list(self._waiters.get(key, ())):
            waiter.set()

    def wake_all(self) -> None:
        for waiters in list(self._waiters.values()):
            for waiter in list(waiters):
                waiter.set()

    @property
    def listening(self) -> bool:
        """Whether commits of other processes are heard (without polling)."""
        return False

    def poll_s(self, fallback: float) -> float:
        """How long a waiter may sleep before it re-reads the database anyway:
        ``fallback`` unless commits of other replicas are heard."""
        return fallback

    async def announce(self, session: AsyncSession, keys: Iterable[str]) -> None:
        """Tells other processes, inside the writing transaction, which keys
        its commit wakes. Nothing to do in process."""

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass


class SoleWriterNotifier(Notifier):
    """In process, for a database only this process writes (SQLite under
    ``berth serve``): every commit is made here and wakes its waiters, so
    waiters re-read the database only as a safety net, as with LISTEN."""

    def __init__(self, *, safety_poll_s: float) -> None:
        super().__init__()
        self.safety_poll_s = safety_poll_s

    @property
    def listening(self) -> bool:
        return True

    def poll_s(self, fallback: float) -> float:
        return max(fallback, self.safety_poll_s)


class PostgresNotifier(Notifier):
    """Wake-ups across replicas through PostgreSQL ``LISTEN``/``NOTIFY`` on one channel."""

    def __init__(
        self,
        dsn: str,
        channel: str,
        *,
        safety_poll_s: float,
        application_name: str = "",
        reconnect_max_s: float = 2.0,
        check_s: float = 30.0,
    ) -> None:
        super().__init__()
        self._dsn = dsn
        self.channel = channel
        self.safety_poll_s = safety_poll_s
        self.application_name = application_name or f"berth_notify_{channel}"
        self._reconnect_max_s = reconnect_max_s
        self._check_s = check_s
        # Tags this process's announcements: it has woken its own waiters already.
        self.origin = secrets.token_hex(6)
        self._task: asyncio.Task[None] | None = None
        self._up = asyncio.Event()
        self._connection: asyncpg.Connection | None = None
        # Times the listener (re)connected; tests and logs read it.
        self.connects = 0

    @property
    def listening(self) -> bool:
        return self._up.is_set()

    @property
    def listener_pid(self) -> int | None:
        """The server process of the listening connection, while it is up."""
        connection = self._connection
        return connection.get_server_pid() if connection is not None and self.listening else None

    def poll_s(self, fallback: float) -> float:
        return max(fallback, self.safety_poll_s) if self.listening else fallback

    async def announce(self, session: AsyncSession, keys: Iterable[str]) -> None:
        for payload in self._payloads(sorted(set(keys))):
            await session.execute(_NOTIFY, {"channel": self.channel, "payload": payload})

    def _payloads(self, keys: list[str]) -> list[str]:
        out: list[str] = []
        current = self.origin
        for key in keys:
            if len(current) + 1 + len(key) > _PAYLOAD_LIMIT and current != self.origin:
                out.append(current)
                current = self.origin
            current += " " + key
        if current != self.origin:
            out.append(current)
        return out

    def _heard(self, _connection: Any, _pid: int, _channel: str, payload: str) -> None:
        origin, _, keys = payload.partition(" ")
        if origin == self.origin:
            return
        for key in keys.split():
            self.wake(key)

    async def start(self, *, timeout_s: float = 10.0) -> None:
        """Starts listening; waits (bounded) for the first connection. Until
        it is up, waiters poll at their fallback interval."""
        self._task = asyncio.create_task(self._run(), name=f"notify-listener-{self.channel}")
        try:
            await asyncio.wait_for(self._up.wait(), timeout_s)
        except TimeoutError:
            log.warning("notify_listener_not_up", channel=self.channel, timeout_s=timeout_s)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        delay = 0.05
        while True:
            try:
                connection = await asyncpg.connect(
                    self._dsn, timeout=5, server_settings={"application_name": self.application_name}
                )
            except Exception as exc:
                log.warning("notify_listener_connect_failed", channel=self.channel, error=repr(exc), retry_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._reconnect_max_s)
                continue
            try:
                await self._listen(connection)
            except Exception as exc:
                log.warning("notify_listener_lost", channel=self.channel, error=repr(exc))
            finally:
                self._connection = None
                if self._up.is_set():
                    self._up.clear()
                    # Waiters fall back to their own polling until the listener is back.
                    self.wake_all()
                connection.terminate()
            delay = 0.05
            await asyncio.sleep(delay)

    async def _listen(self, connection: asyncpg.Connection) -> None:
        lost = asyncio.Event()
        connection.add_termination_listener(lambda _c: lost.set())
        await connection.add_listener(self.channel, self._heard)
        self._connection = connection
        self._up.set()
        self.connects += 1
        log.info("notify_listener_up", channel=self.channel, connects=self.connects, pid=connection.get_server_pid())
        # Resync: whatever was announced while nobody listened is read now.
        self.wake_all()
        while not lost.is_set():
            try:
                await asyncio.wait_for(lost.wait(), self._check_s)
            except TimeoutError:
                # A connection that died silently (no FIN) is noticed here.
                await connection.fetchval("SELECT 1", timeout=5)
        log.warning("notify_listener_lost", channel=self.channel)


def open_notifier(
    db: Database, *, channel: str, safety_poll_s: float, listen: bool = True, sole_writer: bool = False
) -> Notifier:
    """The notifier for a service's database: LISTEN/NOTIFY on PostgreSQL
    (unless ``listen`` is off), in process otherwise; with ``sole_writer``
    (no other process writes this SQLite database) waiters poll only as a
    safety net. The caller starts and closes it."""
    if listen and db.dialect == "postgresql":
        url = db.engine.url
        # The listener connects with asyncpg itself: keep the connection
        # options libpq and asyncpg share; the rest are SQLAlchemy's.
        query = {k: v for k, v in url.query.items() if k in _DSN_OPTIONS}
        dsn = url.set(drivername="postgresql", query=query).render_as_string(hide_password=False)
        return PostgresNotifier(dsn, channel, safety_poll_s=safety_poll_s)
    if sole_writer and db.dialect == "sqlite":
        return SoleWriterNotifier(safety_poll_s=safety_poll_s)
    return Notifier()
