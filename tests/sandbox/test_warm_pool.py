"""WarmPool's bookkeeping, with plain objects for items."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from waiting import wait_until

from services.sandbox.backends._warm_pool import WarmPool


@pytest.fixture(autouse=True)
def _require_bwrap() -> None:
    """No sandbox is started here."""


class Maker:
    def __init__(self) -> None:
        self.ids = itertools.count(1)
        self.discarded: list[str] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail = False
        self.attempts = 0

    async def make(self, key: str) -> str:
        self.attempts += 1
        await self.gate.wait()
        if self.fail:
            raise RuntimeError("engine down")
        return f"{key}-{next(self.ids)}"

    async def discard(self, item: str) -> None:
        self.discarded.append(item)


def _pool(maker: Maker, size: int) -> WarmPool[str, str]:
    return WarmPool(size, maker.make, maker.discard, name="test")


async def test_the_pool_fills_each_key_up_to_its_size_and_no_further() -> None:
    maker = Maker()
    pool = _pool(maker, 2)

    pool.start(["a"])

    await wait_until(lambda: pool.ready("a") == 2)
    pool.refill("a")
    await asyncio.sleep(0)
    assert pool.ready("a") == 2 and pool.ready("b") == 0 and maker.attempts == 2
    await pool.close()


async def test_takers_never_get_the_same_item_and_refill_replaces_what_they_took() -> None:
    maker = Maker()
    pool = _pool(maker, 2)
    pool.start(["a"])
    await wait_until(lambda: pool.ready("a") == 2)

    taken = [pool.take("a"), pool.take("a"), pool.take("a")]

    assert taken == ["a-1", "a-2", None]
    pool.refill("a")
    await wait_until(lambda: pool.ready("a") == 2)
    assert [pool.take("a"), pool.take("a")] == ["a-3", "a-4"]
    await pool.close()


async def test_nothing_is_made_before_start_or_with_size_zero() -> None:
    maker = Maker()
    pool = _pool(maker, 2)
    pool.refill("a")
    empty = _pool(maker, 0)
    empty.start(["a"])

    await asyncio.sleep(0)

    assert pool.ready("a") == 0 and empty.ready("a") == 0
    assert maker.attempts == 0


async def test_fills_of_different_keys_make_one_item_at_a_time_taking_turns() -> None:
    maker = Maker()
    making: list[str] = []
    most_at_once = 0
    real_make = maker.make

    async def make(key: str) -> str:
        nonlocal most_at_once
        making.append(key)
        most_at_once = max(most_at_once, len(making))
        try:
            return await real_make(key)
        finally:
            making.remove(key)

    maker.gate.clear()
    pool: WarmPool[str, str] = WarmPool(2, make, maker.discard, name="test")
    pool.start(["a", "b"])
    await wait_until(lambda: maker.attempts >= 1)
    await asyncio.sleep(0)
    assert maker.attempts == 1  # b waits for a's first item

    maker.gate.set()

    await wait_until(lambda: pool.ready("a") == 2 and pool.ready("b") == 2)
    assert most_at_once == 1
    assert [pool.take("a"), pool.take("b")] == ["a-1", "b-2"]  # turns: a, b, a, b
    await pool.close()


async def test_a_failed_fill_stops_until_the_next_refill() -> None:
    maker = Maker()
    maker.fail = True
    pool = _pool(maker, 1)
    pool.start(["a"])
    await wait_until(lambda: maker.attempts == 1)
    await asyncio.sleep(0)
    assert pool.ready("a") == 0 and maker.attempts == 1

    maker.fail = False
    pool.refill("a")

    await wait_until(lambda: pool.ready("a") == 1)
    await pool.close()


async def test_close_discards_every_ready_item_and_stops_refills() -> None:
    maker = Maker()
    pool = _pool(maker, 2)
    pool.start(["a"])
    await wait_until(lambda: pool.ready("a") == 2)

    await pool.close()

    assert sorted(maker.discarded) == ["a-1", "a-2"]
    pool.refill("a")
    await asyncio.sleep(0)
    assert pool.ready("a") == 0 and maker.attempts == 2


async def test_close_waits_for_a_fill_in_progress_and_discards_what_it_made() -> None:
    maker = Maker()
    maker.gate.clear()
    pool = _pool(maker, 1)
    pool.start(["a"])
    await wait_until(lambda: maker.attempts == 1)  # half made when close begins
    closing = asyncio.create_task(pool.close())
    await asyncio.sleep(0)
    assert not closing.done()

    maker.gate.set()
    await asyncio.wait_for(closing, 5)

    assert maker.discarded == ["a-1"]
    assert pool.ready("a") == 0
