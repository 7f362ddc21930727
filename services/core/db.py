"""Database engines and migrations shared by every service.

Each service owns its own database (its own URL) and its own Alembic version
history; the migration environment is shared. SQLite runs in WAL mode on
Berth's inline driver (services/core/sqlite_inline.py: statements run on the
event loop, waits for locks are asynchronous); PostgreSQL runs through asyncpg.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import bindparam, event
from sqlalchemy.sql.elements import BindParameter
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

from services.core import sqlite_inline

__all__ = ["Database", "create_engine", "migrate"]

_ALEMBIC_DIR = Path(__file__).parent / "alembic"


def create_engine(url: str, *, sqlite_lock_timeout_s: float = 30.0) -> AsyncEngine:
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
    return create_async_engine(url, pool_size=10, max_overflow=20, pool_pre_ping=True)


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


class Database:
    """An engine plus a session factory. The caller owns the unit of work:
    ``async with db.transaction() as s`` is one transaction; repositories
    never commit."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        # SQLite has one writer at a time: this process's writers queue here
        # rather than polling the database lock.
        self._write_lock = asyncio.Lock() if engine.dialect.name == "sqlite" else None
        self._sessions = async_sessionmaker(engine, expire_on_commit=False)
        self._read_sessions = async_sessionmaker(engine.execution_options(berth_read_only=True), expire_on_commit=False)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    @asynccontextmanager
    async def transaction(self, *, read_only: bool = False) -> AsyncIterator[AsyncSession]:
        """One unit of work. ``read_only`` transactions must not write; on
        SQLite they do not take the write lock."""
        if read_only or self._write_lock is None:
            factory = self._read_sessions if read_only else self._sessions
            async with factory() as session, session.begin():
                yield session
            return
        async with self._write_lock, self._sessions() as session, session.begin():
            yield session

    async def dispose(self) -> None:
        await self.engine.dispose()


async def open_database(url: str, service: str, versions: Path) -> Database:
    engine = create_engine(url)
    for attempt in range(3):
        try:
            await migrate(engine, service, versions)
            break
        except Exception:
            if attempt == 2:
                raise
            await asyncio.sleep(0.2 * (attempt + 1))
    return Database(engine)


__all__ += ["open_database", "set_clause", "set_params"]


# Prepared UPDATE statements set columns from bound parameters named
# ``v_<column>``: a bound parameter may not share its column's name in a SET
# clause. ``set_clause`` builds the SET part once (per set of columns);
# ``set_params`` names the values for each execution.
def set_clause(columns: Iterable[str]) -> dict[str, BindParameter[Any]]:
    return {column: bindparam(f"v_{column}") for column in columns}


def set_params(values: Mapping[str, Any]) -> dict[str, Any]:
    return {f"v_{column}": value for column, value in values.items()}
