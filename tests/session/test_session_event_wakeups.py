"""A follower's wake-ups, driven step by step: two stores (two replicas) on
one database, the follower on B, and a commit "heard" from A delivered to
B's notifier as its PostgreSQL listener does. The safety-net poll is an
hour, so only a wake-up can deliver an event."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from session_support import add_idle_session

from services.core.db import open_database
from services.session.event_stream import EventStream
from services.session.store import Store, Unit, events_key

_MIGRATIONS = Path(__file__).parents[2] / "services" / "session" / "migrations" / "versions"
_ORG = "org_a"
_SESSION = "sess_wakeups"


@pytest.fixture
async def stores(tmp_path: Path) -> AsyncIterator[tuple[Store, Store]]:
    url = f"sqlite+berth:///{tmp_path / 'session.db'}"
    a, b = Store(await open_database(url, "session", _MIGRATIONS)), Store(await open_database(url, "session", _MIGRATIONS))

    await a.transact(lambda u: add_idle_session(u, _SESSION, _ORG))
    yield a, b
    await a.db.dispose()
    await b.db.dispose()


async def _emit(store: Store) -> None:
    await store.transact(lambda u: u.emit(_SESSION, {"type": "agent.session.idle"}))


async def _next(events: AsyncIterator[list[tuple[int, str, str]] | int]) -> list[int]:
    batch = await asyncio.wait_for(anext(events), 5.0)
    assert isinstance(batch, list)
    return [seq for seq, _, _ in batch]


async def test_a_follower_fed_a_local_commit_still_reads_a_commit_heard_from_another_replica_meanwhile(
    stores: tuple[Store, Store],
) -> None:
    a, b = stores
    events = await EventStream(b, poll_s=3600.0).stream_events(_ORG, _SESSION, 0, follow=True, keepalive_ms=0)
    assert await _next(events) == [1]
    # While the follower is busy: B commits 2 (fed to it), then A commits 3 and B hears of it.
    await _emit(b)
    await _emit(a)
    b.notifier.wake(events_key(_SESSION))
    assert await _next(events) == [2]
    assert await _next(events) == [3]
    await events.aclose()  # type: ignore[attr-defined]


async def test_a_follower_hears_a_commit_announced_while_it_sends_a_keepalive(stores: tuple[Store, Store]) -> None:
    a, b = stores
    events = await EventStream(b, poll_s=3600.0).stream_events(_ORG, _SESSION, 0, follow=True, keepalive_ms=1)
    assert await _next(events) == [1]
    keepalive = await asyncio.wait_for(anext(events), 5.0)
    assert isinstance(keepalive, int)
    # Suspended at the keep-alive: A commits and B hears of it.
    await _emit(a)
    b.notifier.wake(events_key(_SESSION))
    async with asyncio.timeout(5.0):
        while isinstance(batch := await anext(events), int):
            pass
    assert [seq for seq, _, _ in batch] == [2]
    await events.aclose()  # type: ignore[attr-defined]
