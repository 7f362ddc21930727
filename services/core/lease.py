"""Leases held in a database row, and polling a row until it changes.

A process that owns work (a running turn, an environment's setup) records a
lease expiry on the row and renews it while the work runs; peers that find
the expiry in the past know the owner died. ``Lease`` is the owner's side:
it renews on an interval in a task of its own, and reports a renewal that
found the lease gone (the row no longer names this owner) once, through
``on_lost``. ``poll_until`` is the peers' side: it reads on an interval,
optionally growing, until a check says the wait is over.

A renewal or a check that raises (a database hiccup) is logged and tried
again at the next interval: neither gives up on its own, and both stop only
when told to (or, for ``Lease``, when the lease is lost).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType

from services.core.logging import get_logger

__all__ = ["Lease", "poll_until"]

log = get_logger(__name__)


class Lease:
    """Renews a lease every ``every_s`` seconds until stopped or lost.

    ``renew`` returns whether the lease is still held. Use it as an async
    context manager, or call ``start`` and ``stop``.
    """

    def __init__(
        self,
        renew: Callable[[], Awaitable[bool]],
        *,
        every_s: float,
        on_lost: Callable[[], object] | None = None,
        failure_event: str = "lease_renew_failed",
        log_fields: Mapping[str, object] | None = None,
    ) -> None:
        if every_s <= 0:
            raise ValueError("every_s must be positive")
        self._renew = renew
        self._every_s = every_s
        self._on_lost = on_lost
        self._failure_event = failure_event
        self._log_fields = dict(log_fields or {})
        self._task: asyncio.Task[None] | None = None
        self.lost = False

    def start(self) -> None:
        """Starts renewing in a task of its own; the first renewal is one
        interval from now."""
        if self._task is not None:
            raise RuntimeError("the lease is already started")
        self._task = asyncio.get_running_loop().create_task(self._run(), name="lease-renewer")

    async def stop(self) -> None:
        """Stops renewing and waits until a renewal in flight has ended.
        Safe to call more than once, and after the lease was lost."""
        task = self._task
        if task is None:
            return
        task.cancel()
        # wait() does not raise the renewer's cancellation, but does raise
        # the caller's own.
        await asyncio.wait({task})

    async def __aenter__(self) -> Lease:
        self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._every_s)
            try:
                held = await self._renew()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning(self._failure_event, exc_info=True, **self._log_fields)
                continue
            if not held:
                self.lost = True
                if self._on_lost is not None:
                    self._on_lost()
                return


async def poll_until(
    done: Callable[[], Awaitable[bool]],
    *,
    every_s: float,
    max_every_s: float | None = None,
    growth: float = 1.0,
    failure_event: str = "poll_failed",
    log_fields: Mapping[str, object] | None = None,
) -> None:
    """Waits an interval, then calls ``done``, until it returns True.

    The interval starts at ``every_s`` and is multiplied by ``growth`` after
    each wait, up to ``max_every_s``. Bound the whole wait, if it needs a
    bound, with ``asyncio.timeout`` around the call.
    """
    if every_s <= 0 or growth < 1.0:
        raise ValueError("every_s must be positive and growth at least 1")
    cap = math.inf if max_every_s is None else max(every_s, max_every_s)
    delay = every_s
    fields = dict(log_fields or {})
    while True:
        await asyncio.sleep(delay)
        delay = min(delay * growth, cap)
        try:
            if await done():
                return
        except asyncio.CancelledError:
            raise
        except Exception:
            log.warning(failure_event, exc_info=True, **fields)
