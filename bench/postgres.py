"""The PostgreSQL server benchmarks run on (``BERTH_BENCH_POSTGRES_URL``,
default the local test server), and scratch databases on it."""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg

__all__ = ["SERVER_URL", "scratch_database", "reachable"]

SERVER_URL = os.environ.get("BERTH_BENCH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


async def _admin(sql: str) -> None:
    conn = await asyncpg.connect(SERVER_URL, timeout=5)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def reachable() -> str | None:
    """None when the server answers; otherwise why not."""
    try:
        await _admin("SELECT 1")
    except (OSError, asyncpg.PostgresError, TimeoutError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@asynccontextmanager
async def scratch_database(prefix: str = "berth_bench") -> AsyncIterator[str]:
    """A new database on the server, as a URL; dropped (its connections
    closed) afterwards."""
    name = f"{prefix}_{secrets.token_hex(4)}"
    await _admin(f'CREATE DATABASE "{name}"')
    try:
        yield SERVER_URL.rsplit("/", 1)[0] + f"/{name}"
    finally:
        await _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
