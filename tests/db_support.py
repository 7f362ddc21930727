"""A service's own database for a test, migrated with that service's
migrations; and its server dropping connections under it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Collection
from contextlib import asynccontextmanager
from pathlib import Path

import asyncpg

from services.core.db import Database, open_database
from services.core.settings import normalize_database_url

__all__ = ["migrations_of", "service_database", "terminate_backends"]


def migrations_of(service: str) -> Path:
    return Path(__file__).resolve().parents[1] / "services" / service / "migrations" / "versions"


@asynccontextmanager
async def service_database(database_url: str, service: str) -> AsyncIterator[Database]:
    """``service``'s database at ``database_url``, disposed of on exit."""
    database = await open_database(normalize_database_url(database_url), service, migrations_of(service))
    try:
        yield database
    finally:
        await database.dispose()


async def terminate_backends(database_url: str, pids: Collection[int] | None = None) -> int:
    """Terminates the PostgreSQL backends ``pids`` (every other backend of
    ``database_url``'s database if None), as a server restart or failover
    would, and waits until each has exited; returns how many."""
    admin = await asyncpg.connect(database_url.replace("postgresql+asyncpg://", "postgresql://"), timeout=5)
    try:
        if pids is None:
            pids = [
                row[0]
                for row in await admin.fetch(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
            ]
        for pid in pids:
            await admin.execute("SELECT pg_terminate_backend($1)", pid)
        # Terminating only signals a backend: wait until each has exited.
        async with asyncio.timeout(10):
            while await admin.fetchval("SELECT count(*) FROM pg_stat_activity WHERE pid = any($1::int[])", list(pids)):
                await asyncio.sleep(0.02)
        return len(pids)
    finally:
        await admin.close()
