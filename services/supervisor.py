"""``berth serve``'s supervisor: each service in a process of its own, so that
the services use every core instead of sharing one event loop.

The children are the services' stand-alone entry points (``python -m
services.sandbox`` and so on) with the environment ``berth serve`` computed:
the control sockets, the token file, the data directory. They start together
(they dial each other lazily) and serve once all are ready. Each child runs in
a process group of its own, so a terminal's Ctrl-C or a ``kill`` of the
group reaches the supervisor alone, which then stops the children in the
reverse of their order (the gateway first, the Sandbox service last),
each with its grace period. Each child also holds the read end of a pipe
whose write end only the supervisor holds (its *lifeline*): if the
supervisor dies without stopping them, the pipe ends and the children stop
themselves. A child that exits on its own stops the whole serve."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from services.core.logging import get_logger

__all__ = ["Child", "ChildFailed", "Supervisor"]

log = get_logger("berth.supervisor")

_READY_POLL_S = 0.05
# A stopping child gets its grace plus this long to exit before SIGKILL.
_EXIT_SLACK_S = 5.0


class ChildFailed(Exception):
    """A child exited or did not become ready in time."""


@dataclass(frozen=True)
class Child:
    """A service process: its name, its module (``python -m``), the extra
    environment it gets and the probe that says it serves."""

    name: str
    module: str
    ready: Callable[[], Awaitable[bool]]
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass
class _Running:
    child: Child
    process: asyncio.subprocess.Process


class Supervisor:
    """Starts children together; stops them in the reverse of their order."""

    def __init__(self, *, grace_s: float, start_timeout_s: float) -> None:
        self._grace_s = grace_s
        self._start_timeout_s = start_timeout_s
        self._running: list[_Running] = []
        self._lifeline_read, self._lifeline_write = os.pipe()
        os.set_inheritable(self._lifeline_read, True)

    @property
    def lifeline_fd(self) -> int:
        """The descriptor each child inherits; it reads EOF once the supervisor is gone."""
        return self._lifeline_read

    def pids(self) -> dict[str, int]:
        return {r.child.name: r.process.pid for r in self._running}

    async def start(self, children: list[Child], base_env: Mapping[str, str]) -> None:
        """Starts every child at once (none needs another to start: they dial
        each other lazily) and returns once all are ready."""
        for child in children:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                child.module,
                env={**base_env, **child.env},
                pass_fds=(self._lifeline_read,),
                process_group=0,
            )
            self._running.append(_Running(child, process))
            log.info("serve_child_started", child=child.name, pid=process.pid)
        try:
            async with asyncio.timeout(self._start_timeout_s):
                await asyncio.gather(*(self._ready(r) for r in self._running))
        except TimeoutError:
            raise ChildFailed(f"a service did not become ready within {self._start_timeout_s:.0f} s") from None

    @staticmethod
    async def _ready(running: _Running) -> None:
        while not await running.child.ready():
            if running.process.returncode is not None:
                raise ChildFailed(f"{running.child.name} exited with {running.process.returncode} while starting")
            await asyncio.sleep(_READY_POLL_S)

    async def wait_for_exit(self) -> str:
        """Returns the name of the first child that exits."""
        waits = {asyncio.ensure_future(r.process.wait()): r.child.name for r in self._running}
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()
        return waits[next(iter(done))]

    async def stop(self) -> None:
        """SIGTERM to each child in reverse start order, waiting for each to
        exit (its grace plus slack) before the next; SIGKILL to one that does
        not."""
        os.close(self._lifeline_write)
        for running in reversed(self._running):
            process = running.process
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(process.wait(), self._grace_s + _EXIT_SLACK_S)
                except TimeoutError:
                    log.warning("serve_child_killed", child=running.child.name, pid=process.pid)
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGKILL)
                    await process.wait()
            if process.returncode not in (0, -signal.SIGTERM):
                log.warning("serve_child_exited", child=running.child.name, code=process.returncode)
        os.close(self._lifeline_read)
        self._running.clear()
