"""Fixtures shared by the whole suite: the service database (SQLite and
PostgreSQL), the requirement switches CI sets (BERTH_REQUIRE_*), so required
components are never skipped silently there, and the internal token every
service expects."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from grpc_support import TEST_INTERNAL_TOKEN
from hosts_support import TestHost, make_test_host
from reaping import destroy_local_sandboxes

# The internal token of every Settings() built here and every service process
# spawned from here; grpc_support.internal_channel dials with it.
os.environ["BERTH_INTERNAL_TOKEN"] = TEST_INTERNAL_TOKEN
os.environ.pop("BERTH_INTERNAL_TOKEN_FILE", None)

POSTGRES_SERVER_URL = os.environ.get("BERTH_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


def require_or_skip(what: str, env_flag: str, reason: str) -> None:
    """Skips locally, fails in CI (where ``env_flag`` is set)."""
    if os.environ.get(env_flag) == "1":
        pytest.fail(f"{what} is required here ({env_flag}=1) but unavailable: {reason}")
    pytest.skip(f"{what} unavailable: {reason}")


@pytest.fixture(scope="session")
def bwrap_available() -> None:
    if shutil.which("bwrap") is None:
        require_or_skip("bubblewrap", "BERTH_REQUIRE_BWRAP", "bwrap not on PATH (apt-get install -y bubblewrap)")


@pytest.fixture
def test_host() -> Iterator[TestHost]:
    """A test host that is not the Berth host (whose addresses no sandbox
    reaches), for servers a sandbox must reach; removed afterwards."""
    with make_test_host() as host:
        yield host


@pytest.fixture(autouse=True)
def _reap_sandboxes(tmp_path: Path) -> Iterator[None]:
    """Sandboxes deliberately outlive the service that created them, so every
    test destroys the local sandboxes left under its temporary directory."""
    yield
    root = tmp_path
    data_dirs = {p.parent for p in root.glob("**/sandboxes") if p.is_dir()}
    if not data_dirs:
        return

    async def reap() -> None:
        for data_dir in data_dirs:
            await destroy_local_sandboxes(data_dir)

    asyncio.run(reap())
    # A sandbox that died or never finished starting keeps its workspace
    # filesystem mounted; nothing of this test may stay mounted.
    from services.sandbox.isolation.quota import unmount_under

    asyncio.run(unmount_under(root))


@contextlib.contextmanager
def _new_postgres_database(prefix: str) -> Iterator[str]:
    """Creates a PostgreSQL database and yields its URL; drops it (closing
    any connection left to it) on exit. Skips locally when the server is
    unreachable; fails in CI (BERTH_REQUIRE_POSTGRES=1)."""
    import asyncpg

    name = f"{prefix}_{secrets.token_hex(4)}"

    async def _admin(sql: str) -> None:
        conn = await asyncpg.connect(POSTGRES_SERVER_URL, timeout=3)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    def admin(sql: str) -> None:
        # Often requested from inside a running event loop: use a thread of its own.
        with ThreadPoolExecutor(1) as pool:
            pool.submit(asyncio.run, _admin(sql)).result()

    try:
        admin(f'CREATE DATABASE "{name}"')
    except Exception as exc:  # unreachable server, authentication, ...
        require_or_skip("PostgreSQL", "BERTH_REQUIRE_POSTGRES", f"{POSTGRES_SERVER_URL}: {exc!r}")
    try:
        yield POSTGRES_SERVER_URL.rsplit("/", 1)[0] + f"/{name}"
    finally:
        admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def postgres_database() -> Iterator[str]:
    """A fresh PostgreSQL database for this test run, dropped at the end
    (``database_url`` empties its schema for each test)."""
    with _new_postgres_database("berth_test") as url:
        yield url


@pytest.fixture
def fresh_postgres_database() -> Iterator[str]:
    """A PostgreSQL database of this test alone, dropped afterwards with
    whatever connections killed processes left to it."""
    with _new_postgres_database("berth_fresh") as url:
        yield url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A service database on SQLite, in the test's temporary directory."""
    return f"sqlite+berth:///{tmp_path / 'service.db'}"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def database_url(request: pytest.FixtureRequest, sqlite_url: str) -> str:
    """A service database, once on SQLite (``sqlite_url``) and once on
    PostgreSQL (an empty schema per test)."""
    if request.param == "sqlite":
        return sqlite_url
    import asyncpg

    dsn: str = request.getfixturevalue("postgres_database")
    conn = await asyncpg.connect(dsn, timeout=3)
    try:
        await conn.execute("DROP SCHEMA IF EXISTS public CASCADE; CREATE SCHEMA public;")
    finally:
        await conn.close()
    return dsn
