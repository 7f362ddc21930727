"""Fires automations' due occurrences exactly once across replicas, and
delivers the queued invocations.

Firing: one transaction selects the due automations (``FOR UPDATE SKIP
LOCKED`` on PostgreSQL, so replicas split them instead of queueing behind
each other) and advances each with a compare-and-set on its ``version``;
only the replica whose update matched records the occurrence's invocation,
in the same transaction. A unique (automation, scheduled_at) constraint
backs this. Missed occurrences follow the catch-up rule of ``schedule.py``.

Delivery: a replica takes a queued invocation with a compare-and-set on its
lease, creates the new session or submits the instructions to the existing
one, then records the outcome. A replica that dies mid-delivery leaves the
lease to expire and another replica delivers again: the one window in which
an invocation may be delivered twice.

The schedule reads an injectable clock; leases use the wall clock, since
they measure replica liveness rather than the schedule.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy import select, update

from berth.session.v1 import automation_pb2 as pb
from berth.session.v1 import session_pb2
from berth.session.v1 import session_service_pb2 as svc_pb
from services.core.context import org_id_var
from services.core.errors import BerthError, FailedPrecondition, NotFound
from services.core.logging import get_logger
from services.core.events import wait_set
from services.session.automations import (
    PAUSE_TARGET_SESSION_FAILED,
    SKIP_PENDING_DELIVERY,
    announce_invocation,
    automation_message,
    invocation_message,
    new_invocation,
)
from services.session.models import AutomationRow, InvocationRow
from services.session.schedule import due_occurrence
from services.session.session_input import SessionInput
from services.session.sessions import Sessions
from services.session.states import AutomationKind, AutomationStatus, InvocationStatus
from services.session.store import Store, Unit

__all__ = ["AutomationScheduler", "SessionDelivery", "Deliver", "AutomationNotice"]

log = get_logger(__name__)

Clock = Callable[[], float]
# Delivers a target in an organization; returns the session that received it.
Deliver = Callable[[str, pb.AutomationTarget], Awaitable[str]]
# Told of each invocation's outcome (webhooks hang off this): (org, invocation).
AutomationNotice = Callable[[str, pb.AutomationInvocation], Awaitable[None]]

_BATCH = 50


class SessionDelivery:
    """Delivers targets through the Session service's own domain."""

    def __init__(self, sessions: Sessions, session_input: SessionInput) -> None:
        self.sessions = sessions
        self.input = session_input

    async def __call__(self, org: str, target: pb.AutomationTarget) -> str:
        if target.HasField("new_session"):
            created = await self.sessions.create_session(org, target.new_session.session)
            return str(created.view.message.id)
        existing = target.existing_session
        text = session_pb2.ContentPart(type="input_text", input_text=session_pb2.InputText(text=existing.instructions))
        event = svc_pb.InputEvent(
            type="agent.session.input.message",
            message=svc_pb.InputMessageEvent(input=[svc_pb.InputMessage(role="user", content=[text])]),
        )
        await self.input.submit_events(org, existing.session_id, [event])
        return str(existing.session_id)


def _error_code(exc: BerthError) -> str:
    return exc.reason.lower()


class AutomationScheduler:
    def __init__(
        self,
        store: Store,
        deliver: Deliver,
        *,
        clock: Clock = time.time,
        poll_s: float = 1.0,
        lease_s: float = 30.0,
        notify: AutomationNotice | None = None,
    ) -> None:
        self.store = store
        self.deliver = deliver
        self.clock = clock
        self.poll_s = poll_s
        self.lease_s = lease_s
        self.notify = notify
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._deliveries: set[asyncio.Task[None]] = set()
        self._for_update = store.db.dialect == "postgresql"

    # --- lifecycle ----------------------------------------------------------------------

    def kick(self) -> None:
        """Something changed here (a new due time, a manual run): look now."""
        self._wake.set()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="automation-scheduler")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for task in list(self._deliveries):
            task.cancel()
        if self._deliveries:
            await asyncio.gather(*self._deliveries, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            # Cleared before the pass: a kick that arrives during it is not lost.
            self._wake.clear()
            try:
                await self.tick()
                wait = await self._until_next_due()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("automation_scheduler_failed")
                wait = self.poll_s
            await wait_set(self._wake, wait)

    async def _until_next_due(self) -> float:
        """Sleep to the earliest due time this replica can see, at most
        ``poll_s`` (other replicas' changes, and a clock that tests move)."""
        stmt = (
            select(AutomationRow.next_run_at)
            .where(AutomationRow.status == AutomationStatus.ACTIVE, AutomationRow.next_run_at.is_not(None))
            .order_by(AutomationRow.next_run_at)
            .limit(1)
        )
        due = await self.store.query(lambda s: s.scalar(stmt))
        if due is None:
            return self.poll_s
        return max(0.0, min(self.poll_s, float(due) - self.clock()))

    # --- one pass -----------------------------------------------------------------------

    async def tick(self) -> list[str]:
        """Fires every due occurrence, then delivers the queued invocations
        this replica can take. Returns the invocations it recorded."""
        fired: list[str] = []
        while await self._any_due():
            batch = await self.store.transact(self._fire_due)
            fired += batch
            if len(batch) < _BATCH:
                break
        await self.deliver_queued()
        return fired

    async def _any_due(self) -> bool:
        """A read first: an idle pass takes no write lock (SQLite's is per database)."""
        now = self.clock()
        stmt = (
            select(AutomationRow.id)
            .where(AutomationRow.status == AutomationStatus.ACTIVE, AutomationRow.next_run_at <= now)
            .limit(1)
        )
        return await self.store.query(lambda s: s.scalar(stmt)) is not None

    async def _fire_due(self, u: Unit) -> list[str]:
        now = self.clock()
        stmt = (
            select(AutomationRow)
            .where(AutomationRow.status == AutomationStatus.ACTIVE, AutomationRow.next_run_at <= now)
            .order_by(AutomationRow.next_run_at)
            .limit(_BATCH)
        )
        if self._for_update:
            stmt = stmt.with_for_update(skip_locked=True)
        rows = list((await u.session.execute(stmt)).scalars())
        fired: list[str] = []
        for row in rows:
            assert row.next_run_at is not None
            if row.kind == AutomationKind.PERIODIC:
                occurrence, following = due_occurrence(row.expression, row.timezone, row.next_run_at, now)
                values: dict[str, Any] = {"next_run_at": following}
            else:
                occurrence = row.next_run_at
                values = {"next_run_at": None, "status": AutomationStatus.COMPLETED}
            result = await u.session.execute(
                update(AutomationRow)
                .where(AutomationRow.id == row.id, AutomationRow.version == row.version)
                .values(**values, version=row.version + 1, updated_at=now)
                .execution_options(synchronize_session=False)
            )
            if getattr(result, "rowcount", 0) != 1:
                continue  # another replica fired it
            pending = (
                await u.session.execute(
                    select(InvocationRow.id)
                    .where(
                        InvocationRow.automation_id == row.id,
                        InvocationRow.status == InvocationStatus.QUEUED,
                        InvocationRow.scheduled_at.is_not(None),
                    )
                    .limit(1)
                )
            ).first()
            invocation = new_invocation(row, now, scheduled_at=occurrence)
            if pending is not None:
                # The previous occurrence is still undelivered: this one is skipped.
                invocation.status = InvocationStatus.SKIPPED
                invocation.skip_reason = SKIP_PENDING_DELIVERY
            u.session.add(invocation)
            await announce_invocation(u, invocation)
            fired.append(invocation.id)
            log.info(
                "automation_occurrence_fired",
                automation_id=row.id,
                invocation_id=invocation.id,
                scheduled_at=occurrence,
                skipped=pending is not None,
            )
        return fired

    async def deliver_queued(self) -> None:
        """Takes and delivers the queued invocations whose lease is free."""
        stmt = (
            select(InvocationRow.id)
            .where(InvocationRow.status == InvocationStatus.QUEUED, InvocationRow.lease_until < time.time())
            .order_by(InvocationRow.pk)
            .limit(_BATCH)
        )
        ids = list(await self.store.query(lambda s: s.scalars(stmt)))
        await asyncio.gather(*(self._deliver_one(i) for i in ids))

    async def _claim(self, invocation_id: str) -> tuple[InvocationRow, AutomationRow] | None:
        async def claim(u: Unit) -> tuple[InvocationRow, AutomationRow] | None:
            now = time.time()
            result = await u.session.execute(
                update(InvocationRow)
                .where(
                    InvocationRow.id == invocation_id,
                    InvocationRow.status == InvocationStatus.QUEUED,
                    InvocationRow.lease_until < now,
                )
                .values(lease_until=now + self.lease_s)
                .execution_options(synchronize_session=False)
            )
            if getattr(result, "rowcount", 0) != 1:
                return None
            invocation = (await u.session.execute(select(InvocationRow).where(InvocationRow.id == invocation_id))).scalar_one()
            automation = (
                await u.session.execute(select(AutomationRow).where(AutomationRow.id == invocation.automation_id))
            ).scalar_one_or_none()
            if automation is None:
                return None
            return invocation, automation

        return await self.store.transact(claim)

    async def _deliver_one(self, invocation_id: str) -> None:
        claimed = await self._claim(invocation_id)
        if claimed is None:
            return
        invocation, automation = claimed
        org = invocation.org_id
        token = org_id_var.set(org)
        try:
            target = automation_message(automation).target
            session_id = ""
            failure: BerthError | None = None
            try:
                session_id = await self.deliver(org, target)
            except BerthError as exc:
                failure = exc
            pause = failure is not None and target.HasField("existing_session") and isinstance(
                failure, (NotFound, FailedPrecondition)
            )

            async def finish(u: Unit) -> pb.AutomationInvocation | None:
                row = (await u.session.execute(select(InvocationRow).where(InvocationRow.id == invocation_id))).scalar_one_or_none()
                if row is None:
                    return None  # its automation was deleted meanwhile
                row.updated_at = self.clock()
                if failure is None:
                    row.status = InvocationStatus.COMPLETED
                    row.session_id = session_id
                else:
                    row.status = InvocationStatus.FAILED
                    row.error_code = _error_code(failure)
                    row.error_message = failure.message
                    if target.HasField("existing_session"):
                        row.session_id = target.existing_session.session_id
                if pause:
                    await u.session.execute(
                        update(AutomationRow)
                        .where(AutomationRow.id == automation.id, AutomationRow.status == AutomationStatus.ACTIVE)
                        .values(
                            status=AutomationStatus.PAUSED,
                            pause_reason=PAUSE_TARGET_SESSION_FAILED,
                            next_run_at=None,
                            version=AutomationRow.version + 1,
                            updated_at=self.clock(),
                        )
                        .execution_options(synchronize_session=False)
                    )
                await announce_invocation(u, row)
                return invocation_message(row)

            done = await self.store.transact(finish)
            log.info(
                "automation_invocation_delivered" if failure is None else "automation_invocation_failed",
                automation_id=automation.id,
                invocation_id=invocation_id,
                session_id=session_id,
                reason=failure.reason if failure is not None else "",
            )
            if done is not None and self.notify is not None:
                await self.notify(org, done)
        finally:
            org_id_var.reset(token)
