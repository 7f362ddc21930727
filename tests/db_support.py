"""A service's own database for a test, migrated with that service's migrations."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from services.core.db import Database, open_database
from services.core.settings import normalize_database_url

__all__ = ["migrations_of", "service_database"]


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
