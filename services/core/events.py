"""Waiting for an ``asyncio.Event`` with a bound.

``asyncio.wait_for(event.wait(), timeout)`` loses a cancellation on Python
3.11 when it arrives as the event is set (CPython gh-86296): the waiter
returns normally, and a service loop that was being stopped runs on, so
its ``close`` waits forever. ``asyncio.timeout`` does not: use this."""

from __future__ import annotations

import asyncio

__all__ = ["wait_set"]


async def wait_set(event: asyncio.Event, timeout_s: float) -> bool:
    """Whether ``event`` is set within ``timeout_s`` seconds (at once when
    it already is). A cancellation is always raised."""
    if event.is_set():
        return True
    try:
        async with asyncio.timeout(max(0.0, timeout_s)):
            await event.wait()
    except TimeoutError:
        return False
    return True
