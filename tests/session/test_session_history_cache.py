"""The history a turn starts from, kept between turn starts, on SQLite and
PostgreSQL: a start reads only the items added since the last one; a
compaction, or an item that became visible below what was kept, makes it
read the whole history again; a session that is forgotten is read again.
The session's token estimator is kept with its history, so a turn sizes
only the entries that are new to it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
import pytest
from db_support import service_database
from sqlalchemy import update

from services.core.db import Database
from services.session.harness import context
from services.session.harness.models.base import Entry
from services.session.history_cache import HistoryCache
from services.session.models import ItemRow

_SESSION = "sess_history"


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[Database]:
    async with service_database(database_url, "session") as database:
        yield database


async def _add(db: Database, *texts: str, pk: int | None = None) -> None:
    async with db.transaction() as s:
        for text in texts:
            s.add(
                ItemRow(
                    pk=pk,
                    id=f"item_{text}",
                    session_id=_SESSION,
                    turn_id="turn_1",
                    type="message",
                    item_json="{}",
                    model_json=json.dumps([{"role": "user", "text": text}]),
                    visible=True,
                    created_at=0.0,
                )
            )


async def _spoil(db: Database, text: str) -> None:
    """Makes an item's stored entries unreadable: a read that decodes it fails."""
    async with db.transaction() as s:
        await s.execute(update(ItemRow).where(ItemRow.id == f"item_{text}").values(model_json="not json"))


async def _read(db: Database, cache: HistoryCache, context_from_pk: int = 0) -> list[str]:
    async with db.transaction(read_only=True) as s:
        history = await cache.read(s, _SESSION, context_from_pk)
    return [entries[0]["text"] for _, entries in history]


async def test_a_turn_start_decodes_only_the_items_added_since_the_last_one(db: Database) -> None:
    cache = HistoryCache()
    await _add(db, "a", "b")
    assert await _read(db, cache) == ["a", "b"]
    await _spoil(db, "a")  # kept: not read again
    await _add(db, "c")
    assert await _read(db, cache) == ["a", "b", "c"]
    # Control: a cache that does not know the session reads everything.
    with pytest.raises(json.JSONDecodeError):
        await _read(db, HistoryCache())
    cache.forget(_SESSION)
    with pytest.raises(json.JSONDecodeError):
        await _read(db, cache)


async def test_a_compaction_or_an_item_below_what_was_kept_reads_the_whole_history_again(db: Database) -> None:
    cache = HistoryCache()
    await _add(db, "a", "b", "c")
    assert await _read(db, cache) == ["a", "b", "c"]
    async with db.transaction(read_only=True) as s:
        from_b = (await s.execute(ItemRow.__table__.select().where(ItemRow.id == "item_b"))).one().pk
    assert await _read(db, cache, context_from_pk=from_b) == ["b", "c"]

    # An item that becomes visible below the kept ones (as a slower
    # transaction's would on PostgreSQL) is read with everything else.
    await _add(db, "e", pk=from_b + 10)
    assert await _read(db, cache) == ["a", "b", "c", "e"]
    await _add(db, "d", pk=from_b + 5)
    assert await _read(db, cache) == ["a", "b", "c", "d", "e"]


async def test_the_least_recently_started_session_is_dropped_first(db: Database) -> None:
    cache = HistoryCache(max_sessions=1)
    await _add(db, "a")
    assert await _read(db, cache) == ["a"]
    async with db.transaction(read_only=True) as s:
        await cache.read(s, "sess_other", 0)  # takes the only place
    await _spoil(db, "a")
    with pytest.raises(json.JSONDecodeError):
        await _read(db, cache)


class _CountingSizes:
    """Counts the entries a token estimator serializes to size them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sized = 0
        original = context._chars

        def counted(value: object) -> int:
            self.sized += 1
            return original(value)

        monkeypatch.setattr(context, "_chars", counted)


async def _estimate(db: Database, cache: HistoryCache) -> int:
    async with db.transaction(read_only=True) as s:
        history = await cache.read(s, _SESSION, 0)
    return cache.estimator(_SESSION).entries([entry for _, entries in history for entry in entries])


async def test_a_sessions_token_estimator_is_kept_with_its_history_and_sizes_only_the_entries_added_since(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = HistoryCache()
    sizes = _CountingSizes(monkeypatch)
    await _add(db, "a", "b")
    first = await _estimate(db, cache)
    assert sizes.sized == 2
    await _add(db, "c")
    assert await _estimate(db, cache) > first
    assert sizes.sized == 3
    # Control: a session that is forgotten is sized again, from its first entry.
    cache.forget(_SESSION)
    await _estimate(db, cache)
    assert sizes.sized == 6


def test_a_token_estimator_retains_only_the_sizes_of_the_transcript_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    sizes = _CountingSizes(monkeypatch)
    estimator = context.TokenEstimator()
    long: list[Entry] = [{"role": "user", "text": str(n)} for n in range(200)]
    estimator.entries(long)
    estimator.entries(long[:1])  # a part of it: nothing is forgotten
    estimator.entries(long)
    assert sizes.sized == 200
    estimator.retain(long[-1:])  # compacted: only the last entry is left
    estimator.entries(long)
    assert sizes.sized == 399
