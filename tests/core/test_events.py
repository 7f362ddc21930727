"""``wait_set``: a bounded wait for an event that never loses a cancellation."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from services.core.events import wait_set


async def _wait_for_style(event: asyncio.Event, timeout_s: float) -> bool:
    """What the services did before: ``asyncio.wait_for`` (loses the cancel on 3.11)."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout_s)
        return True
    return False


async def _cancelled_as_set(wait: object) -> bool:
    """Whether a waiter cancelled in the same step as its event is set raises CancelledError."""
    event = asyncio.Event()
    task = asyncio.ensure_future(wait(event, 10))  # type: ignore[operator]
    await asyncio.sleep(0)  # the waiter is waiting
    await asyncio.sleep(0)
    event.set()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return True
    return False


async def test_a_cancellation_that_arrives_as_the_event_is_set_is_raised() -> None:
    assert await _cancelled_as_set(wait_set)


@pytest.mark.skipif(not hasattr(asyncio, "timeout"), reason="asyncio.timeout is Python 3.11+")
async def test_the_wait_for_it_replaces_loses_that_cancellation_here() -> None:
    # Control: the race is real on this interpreter (fixed in CPython 3.12).
    import sys

    if sys.version_info >= (3, 12):
        pytest.skip("wait_for keeps the cancellation from 3.12 on")
    assert not await _cancelled_as_set(_wait_for_style)


async def test_wait_set_says_whether_the_event_was_set_in_time() -> None:
    event = asyncio.Event()
    assert await wait_set(event, 0.01) is False
    event.set()
    assert await wait_set(event, 0) is True
    later = asyncio.Event()
    asyncio.get_running_loop().call_later(0.01, later.set)
    assert await wait_set(later, 5) is True
