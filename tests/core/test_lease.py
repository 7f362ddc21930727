"""The lease renewer and the poller of services/core/lease.py, on real time.

Every wait is bounded by ``asyncio.timeout``; nothing sleeps to make a point.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from services.core.lease import Lease, poll_until

# Generous bounds: the machine running the suite may be busy.
_BOUND_S = 5.0


async def test_a_held_lease_is_renewed_on_every_interval_until_stopped() -> None:
    renewals = 0
    third = asyncio.Event()

    async def renew() -> bool:
        nonlocal renewals
        renewals += 1
        if renewals == 3:
            third.set()
        return True

    lease = Lease(renew, every_s=0.01)
    async with lease:
        async with asyncio.timeout(_BOUND_S):
            await third.wait()
    stopped_at = renewals

    # Let several renewal intervals pass on a clock of the same period.
    ticks = 0

    async def five_ticks() -> bool:
        nonlocal ticks
        ticks += 1
        return ticks == 5

    async with asyncio.timeout(_BOUND_S):
        await poll_until(five_ticks, every_s=0.01)
    assert renewals == stopped_at
    assert not lease.lost


async def test_a_lost_lease_is_reported_once_and_no_longer_renewed() -> None:
    renewals = 0
    reported: list[float] = []
    lost = asyncio.Event()

    async def renew() -> bool:
        nonlocal renewals
        renewals += 1
        return renewals < 2

    def on_lost() -> None:
        reported.append(time.monotonic())
        lost.set()

    lease = Lease(renew, every_s=0.01, on_lost=on_lost)
    lease.start()
    try:
        async with asyncio.timeout(_BOUND_S):
            await lost.wait()
        ticks = 0

        async def five_ticks() -> bool:
            nonlocal ticks
            ticks += 1
            return ticks == 5

        async with asyncio.timeout(_BOUND_S):
            await poll_until(five_ticks, every_s=0.01)
        assert lease.lost
        assert renewals == 2
        assert len(reported) == 1
    finally:
        await lease.stop()
    # Stopping a lost lease is harmless, and so is stopping twice.
    await lease.stop()


async def test_a_renewal_that_raises_is_tried_again_at_the_next_interval() -> None:
    calls = 0
    renewed = asyncio.Event()

    async def renew() -> bool:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ConnectionError("database hiccup")
        renewed.set()
        return True

    async with Lease(renew, every_s=0.01) as lease:
        async with asyncio.timeout(_BOUND_S):
            await renewed.wait()
    assert calls >= 2
    assert not lease.lost


async def test_stopping_waits_for_a_renewal_in_flight_to_end() -> None:
    entered = asyncio.Event()
    ended = False

    async def renew() -> bool:
        nonlocal ended
        entered.set()
        try:
            await asyncio.Event().wait()  # a renewal that never finishes by itself
        finally:
            ended = True
        return True

    lease = Lease(renew, every_s=0.01)
    lease.start()
    async with asyncio.timeout(_BOUND_S):
        await entered.wait()
        await lease.stop()
    assert ended
    assert not lease.lost


async def test_a_lease_cannot_be_started_twice() -> None:
    async def renew() -> bool:
        return True

    async with Lease(renew, every_s=10.0) as lease:
        with pytest.raises(RuntimeError):
            lease.start()


def test_a_lease_needs_a_positive_interval() -> None:
    async def renew() -> bool:
        return True

    with pytest.raises(ValueError):
        Lease(renew, every_s=0)


async def test_polling_ends_as_soon_as_the_condition_holds() -> None:
    checks = 0

    async def third_check() -> bool:
        nonlocal checks
        checks += 1
        return checks == 3

    async with asyncio.timeout(_BOUND_S):
        await poll_until(third_check, every_s=0.01)
    assert checks == 3


async def test_polling_waits_longer_after_each_check() -> None:
    seen: list[float] = []

    async def sixth_check() -> bool:
        seen.append(time.monotonic())
        return len(seen) == 6

    started = time.monotonic()
    async with asyncio.timeout(_BOUND_S):
        await poll_until(sixth_check, every_s=0.02, max_every_s=0.08, growth=2.0)
    gaps = [b - a for a, b in zip([started, *seen], seen, strict=False)]
    # A sleep never ends early; a busy machine may only make it later.
    expected = [0.02, 0.04, 0.08, 0.08, 0.08, 0.08]
    for gap, delay in zip(gaps, expected, strict=True):
        assert gap >= delay * 0.9


async def test_a_check_that_raises_is_tried_again() -> None:
    checks = 0

    async def flaky() -> bool:
        nonlocal checks
        checks += 1
        if checks == 1:
            raise ConnectionError("database hiccup")
        return True

    async with asyncio.timeout(_BOUND_S):
        await poll_until(flaky, every_s=0.01)
    assert checks == 2


async def test_a_condition_that_never_holds_is_bounded_by_the_callers_timeout() -> None:
    async def never() -> bool:
        return False

    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.1):
            await poll_until(never, every_s=0.01)


def test_polling_needs_a_positive_interval_and_no_shrinking() -> None:
    async def done() -> bool:
        return True

    with pytest.raises(ValueError):
        asyncio.run(poll_until(done, every_s=0))
    with pytest.raises(ValueError):
        asyncio.run(poll_until(done, every_s=0.01, growth=0.5))
