"""The init-once guard of an environment, correct across replicas.

``pending -> initializing`` is a compare-and-set on the environment row that
records a lease owner (this process), a lease expiry and a new fencing
version. Exactly one caller wins and starts setup as a detached task, so
cancelling the RPC that triggered it stops only that caller's wait. The owner
renews its lease while setup runs; every later write of the owner (each step
it records in the setup journal, the final status) is fenced by
``init_version`` and ``lease_owner``.

Everyone else waits for the same operation: callers in the owning process
wake on an in-process event, callers in other processes share one poller per
environment that reads the row (20 ms growing to 200 ms). When the owner
stops (killed, or shut down, which ends its lease at once), a poller that
finds the lease expired, or this guard's sweep of expired leases, takes the
setup over with a compare-and-set that bumps the fencing version: the old
owner can write nothing more, and the new one continues from the first step
its journal does not record as done (``setup_steps.py``). Waiters then wait
for the new owner. Only a step that fails, or a setup that outlives
``setup_timeout_s`` under one owner, fails the environment. A Sandbox
service that cannot be reached puts the environment back to ``pending``
with its journal and reports ``SandboxUnavailable``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog
from sqlalchemy.ext.asyncio import AsyncSession

from services.core.context import org_id_var
from services.core.db import Database
from services.core.errors import BerthError, InitializationRunning, NotFound, SandboxUnavailable
from services.core.ids import has_prefix
from services.core.lease import Lease, poll_until
from services.core.logging import get_logger
from services.core.metrics import INIT_DURATION
from services.environment import repository as repo
from services.environment.models import EnvironmentRow, RegisteredFileRow
from services.environment.states import SETTLED_STATUSES, EnvironmentStatus

__all__ = [
    "InitGuard",
    "Setup",
    "SetupFence",
    "SetupFailed",
    "SetupUnavailable",
    "LeaseLost",
]

log = get_logger(__name__)

_T = TypeVar("_T")

# Expired leases the sweep takes over per pass.
_SWEEP_BATCH = 100


class SetupFailed(Exception):
    """Setup failed for good; ``message`` never contains a setup command body."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class SetupUnavailable(Exception):
    """The Sandbox service could not be reached; the environment goes back
    to pending with its journal, and the next caller resumes setup."""


class LeaseLost(Exception):
    """Another process has taken this init operation over, or settled it."""


class SetupFence:
    """Fenced writes available to a running setup: each raises ``LeaseLost``
    when this owner no longer holds the setup (another took it over)."""

    def __init__(self, db: Database, environment_id: str, version: int, owner: str) -> None:
        self._db = db
        self.environment_id = environment_id
        self.version = version
        self.owner = owner
        self.lost = False

    async def mark_sandbox_requested(self, node: str) -> None:
        """Records the node the sandbox is created on, before it is."""
        await self._fenced(
            lambda s: repo.mark_sandbox_requested(s, self.environment_id, version=self.version, owner=self.owner, node=node)
        )

    async def record_step(self, step: str, registered: Sequence[RegisteredFileRow]) -> None:
        """Records ``step`` as done in the setup journal, with the files it
        registered, in one transaction."""

        async def record(s: AsyncSession) -> bool:
            now = time.time()
            if not await repo.record_step(s, self.environment_id, step, version=self.version, owner=self.owner, now=now):
                return False
            for row in registered:
                await repo.upsert_registered_file(s, row)
            return True

        await self._fenced(record)
        log.info("environment_setup_step_done", step=step)

    async def replace_sandbox(self, sandbox_id: str) -> None:
        """Gives the environment a new sandbox and an empty journal."""
        await self._fenced(
            lambda s: repo.replace_sandbox(
                s, self.environment_id, version=self.version, owner=self.owner, sandbox_id=sandbox_id, now=time.time()
            )
        )

    async def _fenced(self, change: Callable[[AsyncSession], Awaitable[bool]]) -> None:
        if not await _fenced_write(self._db, change):
            self.lost = True
            raise LeaseLost(self.environment_id)


async def _fenced_write(db: Database, change: Callable[[AsyncSession], Awaitable[bool]]) -> bool:
    """``change`` (a fenced write that says whether it applied) as one unit
    of work; a database hiccup is retried twice, so it neither fails a setup
    whose steps succeeded nor leaves the row to lease expiry."""
    for attempt in range(3):
        try:
            return await db.run(change)
        except Exception:
            if attempt == 2:
                raise
            log.warning("init_write_retry", attempt=attempt + 1)
            await asyncio.sleep(0.1 * (attempt + 1))
    return False


Setup = Callable[[EnvironmentRow, SetupFence], Awaitable[None]]


@dataclass(eq=False)
class _Operation:
    environment_id: str
    version: int
    done: asyncio.Event = field(default_factory=asyncio.Event)
    # Raised to in-process waiters when the operation ends without a final state.
    error: BerthError | None = None


class InitGuard:
    def __init__(
        self,
        db: Database,
        setup: Setup,
        *,
        instance_id: str,
        lease_s: float,
        setup_timeout_s: float,
        poll_min_s: float = 0.02,
        poll_max_s: float = 0.2,
        sweep_every_s: float | None = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self._db = db
        # Called after every status transition this guard makes (metrics).
        self._on_change = on_change or (lambda: None)
        self._setup = setup
        self.instance_id = instance_id
        self._lease_s = lease_s
        self._setup_timeout_s = setup_timeout_s
        self._poll_min_s = poll_min_s
        self._poll_max_s = poll_max_s
        self._sweep_every_s = sweep_every_s or lease_s / 2
        self._ops: dict[str, _Operation] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    # Public API -------------------------------------------------------------

    async def ensure_ready(self, environment_id: str, org_id: str) -> EnvironmentRow:
        """Starts setup if pending, joins it if running; returns the
        environment once READY or FAILED."""
        waited: _Operation | None = None
        while True:
            row = await self._load(environment_id, org_id)
            if row.status in SETTLED_STATUSES:
                return row
            if row.status == EnvironmentStatus.PENDING:
                if waited is not None:
                    # The operation we waited for went back to pending.
                    raise waited.error or _unavailable(environment_id)
                # Shielded so a caller cancelled right after winning the CAS
                # still leaves a running owner behind.
                op = await asyncio.shield(self._spawn(self._try_start(row)))
                if op is None:
                    continue
            else:
                op = self._join(row)
            waited = op
            await op.done.wait()
            if op.error is not None:
                raise op.error

    async def wait_settled(self, environment_id: str, org_id: str, *, timeout_s: float) -> EnvironmentRow:
        """Waits, without starting anything, until the environment is not
        initializing."""
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    row = await self._load(environment_id, org_id)
                    if row.status != EnvironmentStatus.INITIALIZING:
                        return row
                    await self._join(row).done.wait()
        except TimeoutError:
            raise InitializationRunning(f"environment {environment_id} is still initializing") from None

    def start(self) -> None:
        """Starts the sweep that takes over setups whose owner stopped while
        nobody waits for them (a restarted process, a replica that died)."""
        self._spawn(
            poll_until(
                self._sweep,
                every_s=self._sweep_every_s,
                failure_event="init_sweep_failed",
            )
        )

    async def close(self) -> None:
        """Cancels owners (which end their leases, so a peer or the next
        process takes their setups over at once), pollers and the sweep."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # Internals --------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, _T]) -> asyncio.Task[_T]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _load(self, environment_id: str, org_id: str) -> EnvironmentRow:
        if has_prefix(environment_id, "env"):
            async with self._db.transaction(read_only=True) as s:
                row = await repo.get_environment(s, environment_id, org_id)
            if row is not None:
                return row
        raise NotFound(f"environment {environment_id} not found")

    async def _try_start(self, row: EnvironmentRow) -> _Operation | None:
        now = time.time()
        won = await self._db.run(
            lambda s: repo.start_init(
                s, row.id, version=row.init_version, owner=self.instance_id, lease_expires_at=now + self._lease_s, now=now
            )
        )
        if not won:
            return None
        self._on_change()
        return self._become_owner(row)

    def _become_owner(self, row: EnvironmentRow) -> _Operation:
        """Runs setup for the version this process just won (``row`` is as
        read before the compare-and-set)."""
        op = _Operation(row.id, row.init_version + 1)
        self._ops[row.id] = op
        self._spawn(self._own(op, row))
        return op

    def _join(self, row: EnvironmentRow) -> _Operation:
        op = self._ops.get(row.id)
        if op is None:
            op = _Operation(row.id, row.init_version)
            self._ops[row.id] = op
            self._spawn(self._watch(op))
        return op

    def _finish(self, op: _Operation) -> None:
        if self._ops.get(op.environment_id) is op:
            del self._ops[op.environment_id]
        op.done.set()

    async def _own(self, op: _Operation, row: EnvironmentRow) -> None:
        org_id_var.set(row.org_id)
        structlog.contextvars.bind_contextvars(environment_id=row.id)
        fence = SetupFence(self._db, row.id, op.version, self.instance_id)
        started = time.perf_counter()
        log.info("environment_setup_started", init_version=op.version)
        setup = asyncio.ensure_future(self._setup(row, fence))
        # Setup may end after this owner stopped awaiting it (lease lost, shutdown).
        setup.add_done_callback(lambda t: t.cancelled() or t.exception())
        lease = Lease(
            lambda: self._renew(fence),
            every_s=self._lease_s / 3,
            on_lost=lambda: self._lease_lost(fence, setup),
            failure_event="init_lease_renew_failed",
        )
        lease.start()
        outcome: tuple[str, str, str] | None = None  # (status, code, message)
        try:
            try:
                async with asyncio.timeout(self._setup_timeout_s):
                    await setup
                outcome = (EnvironmentStatus.READY, "", "")
            except SetupFailed as exc:
                outcome = (EnvironmentStatus.FAILED, exc.code, exc.message)
            except SetupUnavailable:
                op.error = _unavailable(row.id)
                await self._write(
                    lambda s: repo.revert_init(s, row.id, version=op.version, owner=self.instance_id, now=time.time())
                )
                self._on_change()
                log.warning("environment_setup_deferred", reason="sandbox_unavailable")
                return
            except TimeoutError:
                outcome = (EnvironmentStatus.FAILED, "setup_timeout", f"setup did not finish in {self._setup_timeout_s:g} seconds")
            except LeaseLost:
                fence.lost = True
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if fence.lost and current is not None and not current.cancelling():
                    pass  # the renewer stopped setup: someone else settled it
                else:
                    # This process is stopping: it ends its lease now, so a
                    # peer (or the next process) takes setup over at once
                    # instead of at lease expiry.
                    op.error = _unavailable(row.id)
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(
                            self._write(
                                lambda s: repo.release_lease(s, row.id, version=op.version, owner=self.instance_id)
                            ),
                            timeout=5,
                        )
                    log.info("environment_setup_released")
                    raise
            except Exception:
                log.exception("environment_setup_crashed")
                outcome = (EnvironmentStatus.FAILED, "setup_internal_error", "setup failed with an internal error")
            finally:
                await lease.stop()
                if not setup.done():
                    setup.cancel()
            if fence.lost or outcome is None:
                op.error = None
                log.warning("environment_setup_lease_lost")
                return
            status, code, message = outcome
            settled = await self._settle(op, status, code, message)
            INIT_DURATION.observe(time.perf_counter() - started)
            if not settled:
                log.warning("environment_setup_lease_lost")
            elif status == EnvironmentStatus.READY:
                log.info("environment_initialized", duration_s=round(time.perf_counter() - started, 3))
            else:
                log.warning("environment_setup_failed", code=code, error=message)
        finally:
            self._finish(op)

    async def _settle(self, op: _Operation, status: str, code: str, message: str) -> bool:
        settled = await self._write(
            lambda s: repo.finish_init(
                s,
                op.environment_id,
                version=op.version,
                owner=self.instance_id,
                status=status,
                error_code=code,
                error_message=message,
                now=time.time(),
            )
        )
        if settled:
            self._on_change()
        return settled

    async def _write(self, change: Callable[[AsyncSession], Awaitable[bool]]) -> bool:
        """A fenced write; losing the final write would otherwise leave the
        row to lease expiry."""
        return await _fenced_write(self._db, change)

    async def _renew(self, fence: SetupFence) -> bool:
        return await self._db.run(
            lambda s: repo.renew_lease(
                s, fence.environment_id, version=fence.version, owner=fence.owner,
                lease_expires_at=time.time() + self._lease_s,
            )
        )

    @staticmethod
    def _lease_lost(fence: SetupFence, setup: asyncio.Future[Any]) -> None:
        fence.lost = True
        setup.cancel()

    async def _watch(self, op: _Operation) -> None:
        """Polls an operation owned by another process until it settles."""
        try:
            await poll_until(
                lambda: self._settled_elsewhere(op),
                every_s=self._poll_min_s,
                max_every_s=self._poll_max_s,
                growth=1.5,
                failure_event="init_poll_failed",
                log_fields={"environment_id": op.environment_id},
            )
        finally:
            self._finish(op)

    async def _settled_elsewhere(self, op: _Operation) -> bool:
        """Whether the operation ended: settled, taken over by anyone, or
        its owner's lease expired, which this process then takes over."""
        async with self._db.transaction(read_only=True) as s:
            row = await repo.get_environment_by_id(s, op.environment_id)
        if row is None or row.status != EnvironmentStatus.INITIALIZING or row.init_version != op.version:
            return True
        if row.lease_expires_at >= time.time():
            return False
        await self._take_over(row)
        return True

    async def _sweep(self) -> bool:
        """One pass of the sweep: takes over every setup whose lease expired
        that this process does not wait for already. Never done."""
        now = time.time()
        expired = await self._db.run(lambda s: repo.expired_inits(s, now=now, limit=_SWEEP_BATCH), read_only=True)
        for found in expired:
            if found.environment_id in self._ops:
                continue  # a poller of this process handles it
            async with self._db.transaction(read_only=True) as s:
                row = await repo.get_environment_by_id(s, found.environment_id)
            if row is not None and row.init_version == found.init_version:
                await self._take_over(row)
        return False

    async def _take_over(self, row: EnvironmentRow) -> None:
        """Becomes the owner of a setup whose owner's lease expired, unless
        another process got there first."""
        now = time.time()
        won = await self._db.run(
            lambda s: repo.take_over_init(
                s, row.id, version=row.init_version, owner=self.instance_id, lease_expires_at=now + self._lease_s, now=now
            )
        )
        if not won:
            return
        log.warning("environment_setup_taken_over", environment_id=row.id, previous_owner=row.lease_owner)
        self._become_owner(row)


def _unavailable(environment_id: str) -> SandboxUnavailable:
    return SandboxUnavailable(
        f"the sandbox of environment {environment_id} is unavailable; setup has not run",
        environment_id=environment_id,
    )
