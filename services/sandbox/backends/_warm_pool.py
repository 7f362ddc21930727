"""Ready-made items per key, kept at a target count by background fills.

The pool knows nothing of what it holds: ``make`` builds one item for a key
and ``discard`` gets rid of one. ``take`` hands out the oldest ready item
without awaiting anything, so two concurrent takers never get the same one.
Each key has at most one fill task, which makes items one after another
until the key holds ``size`` of them, and the fill tasks of all keys take
turns, so the pool makes one item at a time: fills compete with the
foreground work that needs the same engine, and one at a time keeps that
competition small. A failed fill logs and stops; the next ``refill`` (after
the next ``take``) tries again, so a broken engine is retried at the rate
of requests, not in a loop.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

import structlog

__all__ = ["WarmPool"]

log = structlog.stdlib.get_logger(__name__)

_K = TypeVar("_K", bound=Hashable)
_T = TypeVar("_T")


class WarmPool(Generic[_K, _T]):
    def __init__(
        self,
        size: int,
        make: Callable[[_K], Awaitable[_T]],
        discard: Callable[[_T], Awaitable[None]],
        *,
        name: str,
    ) -> None:
        self.size = size
        self._make = make
        self._discard = discard
        self._name = name
        self._ready: dict[_K, deque[_T]] = {}
        self._fillers: dict[_K, asyncio.Task[None]] = {}
        # Held while one item is made; FIFO, so keys take turns.
        self._making = asyncio.Lock()
        self._started = False
        self._closed = False

    def ready(self, key: _K) -> int:
        return len(self._ready.get(key, ()))

    def take(self, key: _K) -> _T | None:
        """The oldest ready item of ``key``, or None when there is none."""
        ready = self._ready.get(key)
        return ready.popleft() if ready else None

    def start(self, keys: list[_K]) -> None:
        """Enables refills and starts filling ``keys``."""
        self._started = True
        for key in keys:
            self.refill(key)

    def refill(self, key: _K) -> None:
        """Starts the key's fill task unless it runs already, the pool is
        full, not started, closed or of size 0."""
        if not self._started or self._closed or key in self._fillers or self.ready(key) >= self.size:
            return
        self._fillers[key] = asyncio.create_task(self._fill(key), name=f"{self._name}-fill")

    async def close(self) -> None:
        """Lets running fills finish (cancelling one could lose an item that
        is half made, e.g. a container the engine creates anyway), then
        discards every ready item."""
        self._closed = True
        await asyncio.gather(*self._fillers.values(), return_exceptions=True)
        items = [item for ready in self._ready.values() for item in ready]
        self._ready.clear()
        await asyncio.gather(*(self._discard_quietly(item) for item in items))

    async def _fill(self, key: _K) -> None:
        try:
            while not self._closed and self.ready(key) < self.size:
                async with self._making:
                    if self._closed:
                        return
                    try:
                        item = await self._make(key)
                    except Exception as exc:
                        log.warning("warm_pool_fill_failed", pool=self._name, key=str(key), error=str(exc))
                        return
                if self._closed:
                    await self._discard_quietly(item)
                    return
                self._ready.setdefault(key, deque()).append(item)
        finally:
            self._fillers.pop(key, None)

    async def _discard_quietly(self, item: _T) -> None:
        try:
            await self._discard(item)
        except Exception as exc:
            log.warning("warm_pool_discard_failed", pool=self._name, error=str(exc))
