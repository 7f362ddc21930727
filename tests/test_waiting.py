"""The suite's bounded wait (``waiting.wait_until``), which every package
relies on: it returns what the check found, and a check that never holds
fails the test in time."""

from __future__ import annotations

import asyncio
import time

import pytest
from waiting import wait_until


async def test_a_plain_check_is_polled_until_it_holds_and_its_value_is_returned() -> None:
    calls: list[int] = []

    def third_call() -> str | None:
        calls.append(1)
        return "found" if len(calls) == 3 else None

    assert await wait_until(third_call, what="the third call") == "found"
    assert len(calls) == 3


async def test_an_async_check_is_awaited() -> None:
    done = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, done.set)

    async def is_done() -> bool:
        return done.is_set()

    assert await wait_until(is_done, 5, what="the event") is True


async def test_a_check_that_never_holds_fails_the_test_within_its_timeout() -> None:
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception):
        await wait_until(lambda: False, timeout=0.05, what="never")
    assert time.monotonic() - started < 2
