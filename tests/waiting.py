"""The suite's one bounded wait. Every test package imports it from here
(``from waiting import wait_until``); no test sleeps for a fixed time to let
something happen."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import TypeVar, overload

import pytest

__all__ = ["wait_until"]

T = TypeVar("T")

_FIRST_DELAY_S = 0.01
_MAX_DELAY_S = 0.1


@overload
async def wait_until(check: Callable[[], Awaitable[T | None]], timeout: float = ..., *, what: str = ...) -> T: ...
@overload
async def wait_until(check: Callable[[], T | None], timeout: float = ..., *, what: str = ...) -> T: ...
async def wait_until(check: Callable[[], object], timeout: float = 10.0, *, what: str = "") -> object:
    """Polls ``check`` (plain or async) until it returns something truthy and
    returns that value; fails the test once ``timeout`` seconds have passed.
    The poll interval starts at 10 ms and backs off to 100 ms."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    delay = _FIRST_DELAY_S
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if loop.time() >= deadline:
            pytest.fail(f"not within {timeout:g}s: {what or check}")
        await asyncio.sleep(delay)
        delay = min(delay * 2, _MAX_DELAY_S)
