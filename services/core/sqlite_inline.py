"""SQLite for SQLAlchemy's asyncio extension without a thread per connection.

``aiosqlite`` runs every cursor call (cursor, execute, fetchall, close,
commit) on a worker thread and wakes the event loop for each result: four
thread round trips per statement, each costing far more CPU than the
statement itself on a small WAL database. This driver runs the standard
``sqlite3`` module on the event loop's thread instead, exposing the
awaitable interface SQLAlchemy's aiosqlite adapter expects, so every
statement is one direct call.

Blocking is bounded by design:

* The connection's busy timeout is 0, so SQLite never sleeps inside a call.
  A statement that finds the database locked (another process holds the
  write lock, or another connection of this process began writing first)
  is retried after an ``asyncio.sleep`` with backoff, for up to
  ``busy_timeout_s``; the event loop keeps running meanwhile, so the
  holder can finish.
* Writers of one ``Database`` queue on an ``asyncio.Lock`` before ``BEGIN
  IMMEDIATE`` (see services/core/db.py), so in-process writers do not poll.
* Reads in WAL mode never wait for writers.

What remains on the loop is the statement's own work (microseconds for the
indexed reads and small writes Berth issues). Checkpoints of the WAL run on
a thread of their own (``WalCheckpointer`` in services/core/db.py).

Use it with the URL scheme ``sqlite+berth:///path`` (registered on import).
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from sqlalchemy.dialects import registry
from sqlalchemy.dialects.sqlite.aiosqlite import (
    AsyncAdapt_aiosqlite_connection,
    AsyncAdapt_aiosqlite_dbapi,
    SQLiteDialect_aiosqlite,
)
from sqlalchemy.util.concurrency import await_

__all__ = ["InlineSQLiteDialect", "Connection", "Cursor", "connect", "is_busy", "DRIVER"]

DRIVER = "berth"
__version__ = "1.0"

# The DB-API names SQLAlchemy's adapter copies from the driver module.
DatabaseError = sqlite3.DatabaseError
Error = sqlite3.Error
IntegrityError = sqlite3.IntegrityError
NotSupportedError = sqlite3.NotSupportedError
OperationalError = sqlite3.OperationalError
ProgrammingError = sqlite3.ProgrammingError
sqlite_version = sqlite3.sqlite_version
sqlite_version_info = sqlite3.sqlite_version_info

_BUSY_FIRST_S = 0.001
_BUSY_MAX_S = 0.05


def is_busy(exc: sqlite3.OperationalError) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return (code & 0xFF) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
    text = str(exc)
    return "locked" in text or "busy" in text


async def _retry_busy(call: Callable[[], Any], deadline_s: float) -> Any:
    """Runs ``call``; while SQLite reports the database busy, sleeps on the
    event loop (1 ms doubling to 50 ms) and tries again, up to the deadline."""
    try:
        return call()
    except sqlite3.OperationalError as exc:
        if not is_busy(exc):
            raise
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    delay = _BUSY_FIRST_S
    while True:
        await asyncio.sleep(delay)
        try:
            return call()
        except sqlite3.OperationalError as exc:
            if not is_busy(exc) or loop.time() >= deadline:
                raise
        delay = min(delay * 2, _BUSY_MAX_S)


class Cursor:
    """An awaitable facade over a ``sqlite3.Cursor``."""

    def __init__(self, connection: Connection, cursor: sqlite3.Cursor) -> None:
        self._connection = connection
        self._cursor = cursor

    async def __aenter__(self) -> Cursor:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def execute(self, sql: str, parameters: Sequence[Any] | dict[str, Any] = ()) -> Cursor:
        await _retry_busy(lambda: self._cursor.execute(sql, parameters), self._connection.busy_timeout_s)
        return self

    async def executemany(self, sql: str, parameters: Iterable[Sequence[Any] | dict[str, Any]]) -> Cursor:
        rows = list(parameters)
        await _retry_busy(lambda: self._cursor.executemany(sql, rows), self._connection.busy_timeout_s)
        return self

    async def fetchone(self) -> Any:
        return self._cursor.fetchone()

    async def fetchmany(self, size: int | None = None) -> list[Any]:
        return self._cursor.fetchmany(size if size is not None else self._cursor.arraysize)

    async def fetchall(self) -> list[Any]:
        return self._cursor.fetchall()

    async def close(self) -> None:
        self._cursor.close()

    async def nextset(self) -> None:
        return None

    async def setinputsizes(self, *sizes: Any) -> None:
        return None

    @property
    def description(self) -> Any:
        return self._cursor.description

    @property
    def rowcount(self) -> int:
        return self._cursor.rowcount

    @property
    def lastrowid(self) -> int | None:
        return self._cursor.lastrowid

    @property
    def arraysize(self) -> int:
        return self._cursor.arraysize

    @arraysize.setter
    def arraysize(self, value: int) -> None:
        self._cursor.arraysize = value


class _Immediate:
    """Stands in for aiosqlite's request queue, which SQLAlchemy's adapter
    uses directly to set ``isolation_level``: runs the function now."""

    def put_nowait(self, request: tuple[asyncio.Future[Any] | None, Callable[[], Any]]) -> None:
        future, function = request
        try:
            result = function()
        except BaseException as exc:
            if future is not None and not future.done():
                future.set_exception(exc)
            return
        if future is not None and not future.done():
            future.set_result(result)


class Connection:
    """The subset of ``aiosqlite.Connection`` SQLAlchemy's adapter uses."""

    def __init__(self, connection: sqlite3.Connection, busy_timeout_s: float) -> None:
        self._connection: sqlite3.Connection | None = connection
        self._tx = _Immediate()
        self.busy_timeout_s = busy_timeout_s

    @property
    def _conn(self) -> sqlite3.Connection:
        if self._connection is None:
            raise ValueError("no active connection")
        return self._connection

    @property
    def isolation_level(self) -> str | None:
        return self._conn.isolation_level

    def cursor(self) -> Cursor:
        return Cursor(self, self._conn.cursor())

    async def execute(self, sql: str, parameters: Sequence[Any] | dict[str, Any] = ()) -> Cursor:
        return await self.cursor().execute(sql, parameters)

    async def commit(self) -> None:
        conn = self._conn
        await _retry_busy(conn.commit, self.busy_timeout_s)

    async def rollback(self) -> None:
        self._conn.rollback()

    async def create_function(self, *args: Any, **kwargs: Any) -> None:
        self._conn.create_function(*args, **kwargs)

    async def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def stop(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None


async def connect(database: str, *, timeout: float = 30.0, **kwargs: Any) -> Connection:
    """Opens the database. ``timeout`` bounds how long a statement waits for
    a lock (asynchronously); SQLite itself never waits."""
    kwargs.pop("check_same_thread", None)
    connection = sqlite3.connect(database, timeout=0, check_same_thread=False, **kwargs)
    return Connection(connection, busy_timeout_s=timeout)


class _DBAPI(AsyncAdapt_aiosqlite_dbapi):
    def connect(self, *args: Any, **kwargs: Any) -> AsyncAdapt_aiosqlite_connection:
        kwargs.pop("async_creator_fn", None)
        connection = await_(connect(*args, **kwargs))
        # SQLAlchemy types its adapter for aiosqlite's class; this one has the same surface.
        return AsyncAdapt_aiosqlite_connection(self, connection)  # type: ignore[arg-type]


class InlineSQLiteDialect(SQLiteDialect_aiosqlite):
    """SQLAlchemy's aiosqlite dialect on this module instead of aiosqlite."""

    driver = DRIVER
    supports_statement_cache = True
    has_terminate = True

    @classmethod
    def import_dbapi(cls) -> AsyncAdapt_aiosqlite_dbapi:
        import sys

        return _DBAPI(sys.modules[__name__], sqlite3)


registry.register(f"sqlite.{DRIVER}", __name__, "InlineSQLiteDialect")
