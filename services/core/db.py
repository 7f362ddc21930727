"""Database engines and migrations shared by every service.

Each service owns its own database (its own URL) and its own Alembic version
history; the migration environment is shared. SQLite runs in WAL mode on
Berth's inline driver (services/core/sqlite_inline.py: statements run on the
event loop, waits for locks are asynchronous); PostgreSQL runs through asyncpg.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy.exc
from alembic import command
from alembic.config import Config
from sqlalchemy import bindparam, event
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.sql.elements import BindParameter
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

from services.core import sqlite_inline
from services.core.errors import DatabaseUnavailable
from services.core.logging import get_logger
from services.core.settings import DatabasePool

__all__ = ["Database", "WalCheckpointer", "create_engine", "migrate", "upsert_insert"]

T = TypeVar("T")

log = get_logger("berth.db")

# SQLSTATEs of a PostgreSQL server that cannot serve a connection now but
# will (besides class 08, connection exceptions): too many connections, an
# administrator's shutdown, a crash shutdown, starting up.
_PASSING_SQLSTATES = frozenset({"53300", "57P01", "57P02", "57P03"})

_ALEMBIC_DIR = Path(__file__).parent / "alembic"


def create_engine(url: str, *, sqlite_lock_timeout_s: float = 30.0, pool: DatabasePool = DatabasePool()) -> AsyncEngine:
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_async_engine(url, connect_args={"timeout": sqlite_lock_timeout_s})
        # Berth's driver waits for locks on the event loop; SQLite must not
        # sleep inside a call. aiosqlite sleeps on its own thread.
        busy_ms = 0 if engine.dialect.driver == sqlite_inline.DRIVER else int(sqlite_lock_timeout_s * 1000)

        @event.listens_for(engine.sync_engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            # Let SQLAlchemy's "begin" hook below emit BEGIN itself.
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute(f"PRAGMA busy_timeout={busy_ms}")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        @event.listens_for(engine.sync_engine, "begin")
        def _sqlite_begin(conn: Connection) -> None:
            # IMMEDIATE takes the write lock up front, so two writers queue on
            # busy_timeout instead of failing with "database is locked" on
            # upgrade. Read-only transactions stay deferred: WAL readers never block.
            if conn.get_execution_options().get("berth_read_only"):
                conn.exec_driver_sql("BEGIN")
            else:
                conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    engine = create_async_engine(url, pool_size=pool.size, max_overflow=pool.max_overflow)
    _ping_when_idle(engine, pool.ping_idle_s)
    return engine


# Where a pooled connection records when it was last returned.
_RETURNED_AT = "berth_returned_at"


def _ping_when_idle(engine: AsyncEngine, idle_s: float) -> None:
    """Pings a connection at checkout only when it sat in the pool longer
    than ``idle_s``. SQLAlchemy's ``pool_pre_ping`` pings every checkout:
    on asyncpg that is three round trips (BEGIN, a query, ROLLBACK), more
    than most of Berth's transactions make themselves. A connection in
    steady use has just proven itself; one that sat idle may have died with
    a database restart, and a dead one is replaced before it is used. The
    first error that shows a disconnect (``is_disconnect``) invalidates the
    whole pool either way."""

    @event.listens_for(engine.sync_engine.pool, "checkin")
    def _returned(_dbapi_conn: Any, record: Any) -> None:
        if record is not None:
            record.info[_RETURNED_AT] = time.monotonic()

    @event.listens_for(engine.sync_engine.pool, "checkout")
    def _checked_out(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        if idle_s > 0:
            returned = record.info.get(_RETURNED_AT)
            if returned is None or time.monotonic() - returned < idle_s:
                # New (it just connected), or in steady use.
                return
        try:
            dbapi_conn.ping()
        except Exception as exc:
            # The pool discards this connection and checks out another.
            raise sqlalchemy.exc.DisconnectionError(f"a pooled connection failed its ping: {exc}") from exc


def _alembic_config(service: str, versions: Path, connection: Connection) -> Config:
    cfg = Config()
    cfg.set_main_option("path_separator", "os")
    cfg.set_main_option("script_location", str(_ALEMBIC_DIR))
    cfg.set_main_option("version_locations", str(versions))
    cfg.attributes["connection"] = connection
    cfg.attributes["version_table"] = f"alembic_version_{service}"
    return cfg


async def migrate(engine: AsyncEngine, service: str, versions: Path) -> None:
    """Upgrades the service's schema to head. Concurrent replicas on
    PostgreSQL serialize on an advisory lock."""

    def _upgrade(conn: Connection) -> None:
        if conn.dialect.name == "postgresql":
            conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock(hashtext('berth_migrate_{service}'))")
        command.upgrade(_alembic_config(service, versions, conn), "head")

    async with engine.begin() as conn:
        await conn.run_sync(_upgrade)


def start_tracked(work: Awaitable[T], inflight: set[asyncio.Future[Any]] | None = None) -> asyncio.Future[T]:
    """Starts ``work`` in a task of its own, whose failure is retrieved even
    when nobody awaits it; ``inflight`` collects the task while it runs, so
    a caller can wait for it to settle."""
    task = asyncio.ensure_future(work)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    if inflight is not None:
        inflight.add(task)
        task.add_done_callback(inflight.discard)
    return task


async def _shielded(work: Awaitable[T], inflight: set[asyncio.Future[Any]] | None = None) -> T:
    """Runs ``work`` to its end in a task of its own. A cancelled caller
    stops waiting; the work goes on."""
    return await asyncio.shield(start_tracked(work, inflight))


class WalCheckpointer:
    """Checkpoints a SQLite database's write-ahead log from a thread of its
    own, on a connection of its own, every ``interval_s``.

    Without it, the connection whose commit fills the WAL past a thousand
    pages checkpoints it inside that commit: on the event loop's thread,
    which then waits for the checkpoint's copy and its two fsyncs (a few
    percent of a busy Session service's loop). The ``Database`` that starts
    one turns its own connections' automatic checkpoints off. ``PASSIVE``
    never waits for readers or writers, and sqlite3 releases the GIL while
    it runs; the next writer after a complete checkpoint starts the log over,
    so it stays about ``interval_s`` of writes long."""

    def __init__(self, path: str, *, interval_s: float = 0.25) -> None:
        self._path = path
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wal-checkpoint", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        # The ``Database``'s connections never checkpoint themselves, so this
        # thread never ends before ``stop``: a connect that fails (the file
        # not there yet, say) is retried every round.
        connection: sqlite3.Connection | None = None
        try:
            while not self._stop.wait(self._interval_s):
                if connection is None:
                    connection = self._connect()
                if connection is not None:
                    self._checkpoint(connection)
        finally:
            if connection is not None:
                connection.close()

    def _connect(self) -> sqlite3.Connection | None:
        try:
            # This thread may wait for a lock (a migration switching the
            # journal mode, say); a PASSIVE checkpoint itself never waits.
            connection = sqlite3.connect(self._path, timeout=1.0, isolation_level=None, check_same_thread=False)
        except sqlite3.Error:
            return None
        # The same durability as the service's connections: fsync at
        # checkpoints (and more, FULL, should even this fail).
        with contextlib.suppress(sqlite3.Error):
            connection.execute("PRAGMA synchronous=NORMAL")
        return connection

    def _checkpoint(self, connection: sqlite3.Connection) -> None:
        try:
            # A read first: a connection opened before the database was in
            # WAL mode learns that it is only when it next reads.
            connection.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()
            connection.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        except sqlite3.Error:
            # Busy (another checkpoint, a schema change): the next round tries again.
            pass

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def _sqlite_file(engine: AsyncEngine) -> str | None:
    """The database file of an engine on Berth's inline SQLite driver."""
    if engine.dialect.name != "sqlite" or engine.dialect.driver != sqlite_inline.DRIVER:
        return None
    path = engine.url.database
    return path if path and path != ":memory:" else None


class Database:
    """An engine plus a session factory. The caller owns the unit of work:
    ``async with db.transaction() as s`` or ``await db.run(fn)`` is one
    transaction; repositories never commit.

    Transactions are shielded from their caller's cancellation (a client
    disconnect, a turn cancel, a timeout): once begun, a commit or rollback
    runs to its end in a task of its own and then returns the connection
    and SQLite's write lock. An interrupted ending would leave the
    connection checked out inside an open transaction, holding SQLite's
    write lock. ``run`` shields the whole unit of work as well.

    A unit that fails for a reason that passes (``_passing``: a lost or
    refused connection, a server restarting, a full pool, SQLite's lock held
    too long) raises ``DatabaseUnavailable``, which callers see as
    UNAVAILABLE (a 503 at the gateway) instead of an internal error; a
    read-only ``run`` that lost its connection is tried once more.

    On the inline SQLite driver its WAL is checkpointed off the event loop
    (``WalCheckpointer``) until ``dispose``."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._checkpointer: WalCheckpointer | None = None
        path = _sqlite_file(engine)
        if path is not None:
            self._checkpointer = WalCheckpointer(path)
            event.listen(engine.sync_engine, "connect", _no_autocheckpoint)
            self._checkpointer.start()
        # SQLite has one writer at a time: this process's writers queue here
        # rather than polling the database lock.
        self._write_lock = asyncio.Lock() if engine.dialect.name == "sqlite" else None
        self._sessions = async_sessionmaker(engine, expire_on_commit=False)
        read_options: dict[str, Any] = {"berth_read_only": True}
        if engine.dialect.name == "postgresql":
            # Under READ COMMITTED every statement takes a snapshot of its
            # own inside a transaction too, so a read-only unit runs its
            # statements as they are: without BEGIN and COMMIT, two of the
            # three round trips of a one-query read.
            read_options["isolation_level"] = "AUTOCOMMIT"
        self._read_sessions = async_sessionmaker(engine.execution_options(**read_options), expire_on_commit=False)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def transaction(self, *, read_only: bool = False) -> AbstractAsyncContextManager[AsyncSession]:
        """One unit of work. ``read_only`` transactions must not write; on
        SQLite they do not take the write lock. The body runs in the caller's
        task: cancelled there, the transaction rolls back; a body that
        finished commits, however its caller is cancelled meanwhile."""
        return self._unit(read_only, shield_end=True)

    async def run(
        self,
        fn: Callable[[AsyncSession], Awaitable[T]],
        *,
        read_only: bool = False,
        inflight: set[asyncio.Future[Any]] | None = None,
        after_commit: Callable[[T], None] | None = None,
    ) -> T:
        """``fn`` as one unit of work in a task of its own: a cancelled caller
        stops waiting, and the transaction still runs to its end (see
        ``_shielded`` on ``inflight``). ``after_commit`` sees the result once
        the transaction has committed, in the same task."""

        async def work() -> T:
            try:
                result = await self._run_unit(fn, read_only)
            except DatabaseUnavailable as exc:
                # A read that lost its connection is tried once more: the
                # disconnect replaced the pool, and reading again changes nothing.
                if not (read_only and _disconnected(exc.__cause__)):
                    raise
                result = await self._run_unit(fn, read_only)
            if after_commit is not None:
                after_commit(result)
            return result

        return await _shielded(work(), inflight)

    async def _run_unit(self, fn: Callable[[AsyncSession], Awaitable[T]], read_only: bool) -> T:
        # Called in a shielded task already: its ending needs no task of its own.
        async with self._unit(read_only, shield_end=False) as session:
            return await fn(session)

    @asynccontextmanager
    async def _unit(self, read_only: bool, *, shield_end: bool) -> AsyncIterator[AsyncSession]:
        try:
            lock = None if read_only else self._write_lock
            if lock is not None:
                await lock.acquire()
            session = (self._read_sessions if read_only else self._sessions)()
            try:
                yield session
            except BaseException:
                end = self._end(session, lock, commit=False)
                await (_shielded(end) if shield_end else end)
                raise
            end = self._end(session, lock, commit=True)
            await (_shielded(end) if shield_end else end)
        except Exception as exc:
            if not _passing(exc):
                raise
            # The driver's own message: SQLAlchemy's would quote the statement and its parameters.
            cause = exc.orig if isinstance(exc, sqlalchemy.exc.DBAPIError) and exc.orig is not None else exc
            log.warning("database_unavailable", read_only=read_only, error_type=type(cause).__name__, error=str(cause)[:300])
            raise DatabaseUnavailable("the service's database is unavailable at the moment; try again") from exc

    @staticmethod
    async def _end(session: AsyncSession, lock: asyncio.Lock | None, *, commit: bool) -> None:
        try:
            if commit:
                await session.commit()
        finally:
            try:
                # Rolls back what is left open and returns the connection.
                await session.close()
            finally:
                if lock is not None:
                    lock.release()

    async def dispose(self) -> None:
        if self._checkpointer is not None:
            await asyncio.to_thread(self._checkpointer.stop)
        await self.engine.dispose()


def _disconnected(exc: BaseException | None) -> bool:
    """The unit lost its connection (the pool has replaced its connections)."""
    return isinstance(exc, sqlalchemy.exc.DisconnectionError) or (
        isinstance(exc, sqlalchemy.exc.DBAPIError) and exc.connection_invalidated
    )


def _passing(exc: BaseException) -> bool:
    """A failure of the database that passes and says nothing of the unit's
    own work: a lost or refused connection (asyncpg raises a refused connect
    as a bare ``ConnectionError``), a server shutting down or starting up,
    every pooled connection busy past the pool's timeout, SQLite's lock held
    past its timeout. A constraint violation or a bad query is not one."""
    if _disconnected(exc) or isinstance(exc, (sqlalchemy.exc.TimeoutError, ConnectionError)):
        return True
    if not isinstance(exc, sqlalchemy.exc.DBAPIError):
        return False
    if isinstance(exc.orig, sqlite3.OperationalError):
        return sqlite_inline.is_busy(exc.orig)
    state = str(getattr(exc.orig, "sqlstate", "") or "")
    return state.startswith("08") or state in _PASSING_SQLSTATES


def _no_autocheckpoint(dbapi_conn: Any, _record: Any) -> None:
    """A connection of a ``Database`` whose ``WalCheckpointer`` checkpoints for it."""
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA wal_autocheckpoint=0")
    cur.close()


async def open_database(url: str, service: str, versions: Path, *, pool: DatabasePool = DatabasePool()) -> Database:
    engine = create_engine(url, pool=pool)
    for attempt in range(3):
        try:
            await migrate(engine, service, versions)
            break
        except Exception:
            if attempt == 2:
                raise
            await asyncio.sleep(0.2 * (attempt + 1))
    return Database(engine)


__all__ += ["open_database", "set_clause", "set_params", "start_tracked"]


# Prepared UPDATE statements set columns from bound parameters named
# ``v_<column>``: a bound parameter may not share its column's name in a SET
# clause. ``set_clause`` builds the SET part once (per set of columns);
# ``set_params`` names the values for each execution.
def upsert_insert(dialect: str, table: Any) -> Any:
    """``INSERT`` of ``dialect`` (``postgresql`` or ``sqlite``) into
    ``table``, the form that takes ``on_conflict_do_update`` and
    ``on_conflict_do_nothing``: the one place the two dialects' upserts are
    told apart."""
    return (postgresql.insert if dialect == "postgresql" else sqlite.insert)(table)


def set_clause(columns: Iterable[str]) -> dict[str, BindParameter[Any]]:
    return {column: bindparam(f"v_{column}") for column in columns}


def set_params(values: Mapping[str, Any]) -> dict[str, Any]:
    return {f"v_{column}": value for column, value in values.items()}
