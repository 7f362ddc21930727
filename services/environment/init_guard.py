"""The init-once guard of an environment, correct across replicas.

``pending -> initializing`` is a compare-and-set on the environment row that
records a lease owner (this process), a lease expiry and a new fencing
version. Exactly one caller wins and starts setup as a detached task, so
cancelling the RPC that triggered it stops only that caller's wait. The owner
renews its lease while setup runs; every later write of the owner is fenced
by ``init_version`` and ``lease_owner``.

Everyone else waits for the same operation: callers in the owning process
wake on an in-process event, callers in other processes share one poller per
environment that reads the row (20 ms growing to 200 ms). A poller that finds
the lease expired marks the environment failed with ``setup_owner_lost``.
Setup is never run twice and never retried; the single exception is a Sandbox
service that cannot be reached before any non-idempotent step ran, which puts
the environment back to ``pending`` and reports ``SandboxUnavailable``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog

from services.core.context import org_id_var
from services.core.db import Database
from services.core.errors import BerthError, InitializationRunning, NotFound, SandboxUnavailable
from services.core.ids import has_prefix
from services.core.lease import Lease, poll_until
from services.core.logging import get_logger
from services.core.metrics import INIT_DURATION
from services.environment import repository as repo
from services.environment.models import (
    EnvironmentRow,
)
from services.environment.states import SETTLED_STATUSES, EnvironmentStatus

__all__ = [
    "InitGuard",
    "Setup",
    "SetupFence",
    "SetupFailed",
    "SetupUnavailable",
    "LeaseLost",
    "OWNER_LOST_CODE",
]

log = get_logger(__name__)

_T = TypeVar("_T")

OWNER_LOST_CODE = "setup_owner_lost"


class SetupFailed(Exception):
    """Setup failed for good; ``message`` never contains a setup command body."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class SetupUnavailable(Exception):
    """The Sandbox service could not be reached before any non-idempotent
    setup step ran; the environment goes back to pending."""


class LeaseLost(Exception):
    """Another process has already settled this init operation."""


class SetupFence:
    """Fenced writes available to a running setup."""

    def __init__(self, db: Database, environment_id: str, version: int, owner: str) -> None:
        self._db = db
        self.environment_id = environment_id
        self.version = version
        self.owner = owner
        self.lost = False

    async def mark_sandbox_requested(self, node: str) -> None:
        """Records the node the sandbox is created on, before it is."""
        async with self._db.transaction() as s:
            ok = await repo.mark_sandbox_requested(
                s, self.environment_id, version=self.version, owner=self.owner, node=node
            )
        if not ok:
            self.lost = True
            raise LeaseLost(self.environment_id)


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

    async def close(self) -> None:
        """Cancels owners (which record their environments as failed) and pollers."""
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
        async with self._db.transaction() as s:
            won = await repo.start_init(
                s, row.id, version=row.init_version, owner=self.instance_id, lease_expires_at=now + self._lease_s, now=now
            )
        if not won:
            return None
        self._on_change()
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
                    # This process is stopping: its owner dies, so the
                    # environment fails now rather than at lease expiry.
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(
                            self._settle(
                                op, EnvironmentStatus.FAILED, OWNER_LOST_CODE, "setup was interrupted because its service stopped"
                            ),
                            timeout=5,
                        )
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

    async def _write(self, change: Callable[..., Awaitable[bool]]) -> bool:
        """A fenced write; a database hiccup is retried, since losing the
        final write would otherwise leave the row to lease expiry."""
        for attempt in range(3):
            try:
                async with self._db.transaction() as s:
                    return await change(s)
            except Exception:
                if attempt == 2:
                    raise
                log.warning("init_write_retry", attempt=attempt + 1)
                await asyncio.sleep(0.1 * (attempt + 1))
        return False

    async def _renew(self, fence: SetupFence) -> bool:
        async with self._db.transaction() as s:
            return await repo.renew_lease(
                s, fence.environment_id, version=fence.version, owner=fence.owner,
                lease_expires_at=time.time() + self._lease_s,
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
        """Whether the operation ended; an owner whose lease expired is
        recorded as lost, which ends it."""
        async with self._db.transaction() as s:
            row = await repo.get_environment_by_id(s, op.environment_id)
            if row is None or row.status != EnvironmentStatus.INITIALIZING or row.init_version != op.version:
                return True
            if row.lease_expires_at >= time.time():
                return False
            failed = await repo.fail_expired_init(
                s,
                op.environment_id,
                version=op.version,
                now=time.time(),
                error_code=OWNER_LOST_CODE,
                error_message="the process running setup stopped; setup is not retried",
            )
        if failed:
            self._on_change()
            log.warning("environment_setup_owner_lost", environment_id=op.environment_id)
        return True


def _unavailable(environment_id: str) -> SandboxUnavailable:
    return SandboxUnavailable(
        f"the sandbox of environment {environment_id} is unavailable; setup has not run",
        environment_id=environment_id,
    )
