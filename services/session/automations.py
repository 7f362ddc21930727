"""Automations: schedules that deliver input to a new session or an existing
one, and their invocations. Create, read, list, update, delete, pause,
resume and manual invocations, scoped by organization (another
organization's automation, invocation, session, agent or environment is
``NotFound``). The scheduler (``automation_scheduler.py``) fires the due
occurrences and delivers the queued invocations.

The schedule rules have their home here: ``next_run_at`` is the next
occurrence the scheduler fires, null while paused or completed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession

from berth.session.v1 import automation_pb2 as pb
from services.core.errors import FailedPrecondition, InvalidArgument, NotFound
from services.core.ids import new_id
from services.session import repository as repo
from services.session import views
from services.session.agents import config_message, new_config
from services.session.environment_client import EnvironmentClient
from services.session.harness.automation_tool import AgentSchedule
from services.session.models import AutomationRow, InvocationRow
from services.session.repository import Page
from services.session.schedule import check_expression, check_timezone, next_occurrence
from services.session.states import (
    AUTOMATION_KIND_FROM_PROTO,
    AUTOMATION_KIND_TO_PROTO,
    AUTOMATION_STATUS_TO_PROTO,
    INVOCATION_STATUS_TO_PROTO,
    AutomationKind,
    AutomationStatus,
    InvocationStatus,
)
from services.session.store import Store, Unit
from services.session.webhooks import enqueue as enqueue_webhook

__all__ = [
    "Automations",
    "AgentSchedule",
    "automation_message",
    "invocation_message",
    "new_invocation",
    "UPDATABLE_PATHS",
    "PAUSE_TARGET_SESSION_FAILED",
    "SKIP_PENDING_DELIVERY",
]

Clock = Callable[[], float]

UPDATABLE_PATHS = frozenset({"name", "metadata", "expression", "timezone", "run_at", "target"})
PAUSE_TARGET_SESSION_FAILED = "target_session_failed"
SKIP_PENDING_DELIVERY = "pending_delivery"
_MAX_NAME = 256
_MAX_INSTRUCTIONS = 256 * 1024


def automation_message(row: AutomationRow) -> pb.Automation:
    target = pb.AutomationTarget()
    target.ParseFromString(row.target_pb)
    out = pb.Automation(
        id=row.id,
        org_id=row.org_id,
        name=row.name,
        metadata=json.loads(row.metadata_json),
        kind=AUTOMATION_KIND_TO_PROTO[AutomationKind(row.kind)],
        expression=row.expression,
        timezone=row.timezone,
        run_at=int(row.run_at or 0),
        status=AUTOMATION_STATUS_TO_PROTO[AutomationStatus(row.status)],
        pause_reason=row.pause_reason,
        target=target,
        create_time=views.timestamp(row.created_at),
    )
    if row.creator_session_id:
        out.agent_creator.session_id = row.creator_session_id
        out.agent_creator.tool_call_id = row.creator_tool_call_id
    return out


def invocation_message(row: InvocationRow) -> pb.AutomationInvocation:
    out = pb.AutomationInvocation(
        id=row.id,
        automation_id=row.automation_id,
        create_time=views.timestamp(row.created_at),
        status=INVOCATION_STATUS_TO_PROTO[InvocationStatus(row.status)],
        session_id=row.session_id,
        skip_reason=row.skip_reason,
        error_code=row.error_code,
        error_message=row.error_message,
    )
    if row.scheduled_at is not None:
        out.scheduled_at = int(row.scheduled_at)
    if row.snapshot_pb is not None:
        out.snapshot.ParseFromString(row.snapshot_pb)
    return out


async def announce_invocation(u: Unit, row: InvocationRow) -> None:
    """Enqueues the webhook event of the invocation's status, in ``u``'s
    transaction (``agent.automation.invocation.<status>``); its data names
    the invocation, as OpenAI's webhook events name their object."""
    data: dict[str, Any] = {"id": row.id, "automation_id": row.automation_id, "status": str(row.status)}
    if row.session_id:
        data["session_id"] = row.session_id
    await enqueue_webhook(u, row.org_id, f"agent.automation.invocation.{row.status}", data)


def new_invocation(
    automation: AutomationRow,
    now: float,
    *,
    scheduled_at: float | None = None,
    status: InvocationStatus = InvocationStatus.QUEUED,
    skip_reason: str = "",
) -> InvocationRow:
    """A queued (or skipped) invocation; scheduled ones carry the automation
    as it was when the occurrence fired."""
    return InvocationRow(
        id=new_id("ainv"),
        org_id=automation.org_id,
        automation_id=automation.id,
        scheduled_at=scheduled_at,
        status=status,
        session_id="",
        skip_reason=skip_reason,
        error_code="",
        error_message="",
        snapshot_pb=automation_message(automation).SerializeToString() if scheduled_at is not None else None,
        lease_until=0.0,
        created_at=now,
        updated_at=now,
    )


async def _get(s: AsyncSession, org: str, automation_id: str) -> AutomationRow:
    row = (
        await s.execute(select(AutomationRow).where(AutomationRow.id == automation_id, AutomationRow.org_id == org))
    ).scalar_one_or_none()
    if row is None:
        raise NotFound(f"automation {automation_id} not found", param="automation_id")
    return row


def _first_run(row: AutomationRow, now: float) -> float:
    if row.kind == AutomationKind.PERIODIC:
        return next_occurrence(row.expression, row.timezone, now)
    assert row.run_at is not None
    return row.run_at


class Automations:
    def __init__(
        self,
        store: Store,
        env_client: EnvironmentClient | None,
        *,
        clock: Clock = time.time,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.store = store
        self.env = env_client
        self.clock = clock
        # Wakes the local scheduler: a new due time or a queued manual run.
        self.on_change = on_change

    # --- validation ---------------------------------------------------------------------

    def _check_schedule(self, kind: AutomationKind, a: pb.Automation, paths: set[str]) -> None:
        now = self.clock()
        if kind == AutomationKind.PERIODIC:
            if "run_at" in paths:
                raise InvalidArgument("run_at is only accepted for one-time automations", param="run_at")
            check_timezone(a.timezone)
            check_expression(a.expression, a.timezone)
        else:
            for field in ("expression", "timezone"):
                if field in paths:
                    raise InvalidArgument(f"{field} is only accepted for periodic automations", param=field)
            if "run_at" in paths and a.run_at <= now:
                raise InvalidArgument("run_at must be in the future", param="run_at")

    async def _check_target(self, org: str, target: pb.AutomationTarget, creator_session_id: str) -> pb.AutomationTarget:
        """The target with what it references checked, as stored."""
        out = pb.AutomationTarget()
        out.CopyFrom(target)
        kind = target.WhichOneof("target")
        if kind == "existing_session":
            existing = target.existing_session
            if not existing.instructions.strip() or len(existing.instructions) > _MAX_INSTRUCTIONS:
                raise InvalidArgument("target.instructions must be non-blank text", param="target.instructions")
            if creator_session_id and existing.session_id != creator_session_id:
                raise InvalidArgument(
                    "an agent-created automation targets its creator session", param="target.session_id"
                )
            session_id = existing.session_id
            await self.store.query(lambda s: repo.get_session(s, org, session_id))
            return out
        if kind != "new_session":
            raise InvalidArgument("target.type is required", param="target.type")
        request = target.new_session.session
        if request.agent_id:
            agent_id = request.agent_id
            try:
                await self.store.query(lambda s: repo.get_agent(s, org, agent_id))
            except NotFound as exc:
                raise NotFound(exc.message, param="target.agent_id") from exc
            out.new_session.ClearField("effective_agent")
        else:
            out.new_session.effective_agent.CopyFrom(
                config_message(new_config(request.agent, prefix="target.agent", persisted=False))
            )
        if request.environment.WhichOneof("environment") == "environment_id":
            if self.env is None:
                raise FailedPrecondition("no environment service is configured", param="target.environment")
            try:
                await self.env.get_environment(request.environment.environment_id)
            except NotFound as exc:
                raise NotFound(exc.message, param="target.environment.environment_id") from exc
        return out

    # --- automations --------------------------------------------------------------------

    async def create(self, org: str, a: pb.Automation, *, creator: pb.AgentCreator | None = None) -> pb.Automation:
        kind = AUTOMATION_KIND_FROM_PROTO.get(a.kind)
        if kind is None:
            raise InvalidArgument("type must be 'periodic' or 'once'", param="type")
        if not a.name.strip() or len(a.name) > _MAX_NAME:
            raise InvalidArgument(f"name must be 1 to {_MAX_NAME} characters", param="name")
        self._check_schedule(kind, a, {"run_at"} if kind == AutomationKind.ONCE else set())
        creator_session_id = creator.session_id if creator is not None else ""
        target = await self._check_target(org, a.target, creator_session_id)
        now = self.clock()
        row = AutomationRow(
            id=new_id("auto"),
            org_id=org,
            name=a.name,
            kind=kind,
            expression=a.expression if kind == AutomationKind.PERIODIC else "",
            timezone=a.timezone if kind == AutomationKind.PERIODIC else "",
            run_at=float(a.run_at) if kind == AutomationKind.ONCE else None,
            status=AutomationStatus.ACTIVE,
            pause_reason="",
            creator_session_id=creator_session_id,
            creator_tool_call_id=creator.tool_call_id if creator is not None else "",
            target_session_id=target.existing_session.session_id if target.HasField("existing_session") else "",
            target_pb=target.SerializeToString(),
            metadata_json=json.dumps(dict(a.metadata)),
            next_run_at=None,
            version=1,
            created_at=now,
            updated_at=now,
        )
        row.next_run_at = _first_run(row, now)

        async def insert(u: Unit) -> pb.Automation:
            u.session.add(row)
            return automation_message(row)

        created = await self.store.transact(insert)
        self.on_change()
        return created

    async def create_for_agent(self, org: str, session_id: str, tool_call_id: str, spec: AgentSchedule) -> pb.Automation:
        """The ``automations`` tool: a follow-up delivered to the calling session."""
        a = pb.Automation(
            name=spec.name,
            target=pb.AutomationTarget(
                existing_session=pb.ExistingSessionTarget(session_id=session_id, instructions=spec.instructions)
            ),
        )
        if spec.run_at is not None or spec.delay_seconds is not None:
            a.kind = pb.AUTOMATION_KIND_ONCE
            a.run_at = spec.run_at if spec.run_at is not None else int(self.clock()) + (spec.delay_seconds or 0)
        else:
            a.kind = pb.AUTOMATION_KIND_PERIODIC
            a.expression = spec.expression
            a.timezone = spec.timezone
        return await self.create(org, a, creator=pb.AgentCreator(session_id=session_id, tool_call_id=tool_call_id))

    async def get(self, org: str, automation_id: str) -> pb.Automation:
        return automation_message(await self.store.query(lambda s: _get(s, org, automation_id)))

    async def list_automations(self, org: str, page: Page, session_id: str = "") -> tuple[list[pb.Automation], bool]:
        scope: list[Any] = [AutomationRow.org_id == org]
        if session_id:
            await self.store.query(lambda s: repo.get_session(s, org, session_id))
            scope.append(AutomationRow.target_session_id == session_id)
        rows, more = await self.store.query(lambda s: repo.paginate(s, AutomationRow, scope, page))
        return [automation_message(r) for r in rows], more

    async def update(self, org: str, a: pb.Automation, paths: set[str]) -> pb.Automation:
        unknown = sorted(paths - UPDATABLE_PATHS)
        if unknown:
            raise InvalidArgument(f"{unknown[0]} cannot be updated", param=unknown[0])
        current = await self.store.query(lambda s: _get(s, org, a.id))
        kind = AutomationKind(current.kind)
        merged = automation_message(current)
        for path in paths:
            if path == "metadata":
                merged.metadata.clear()
                merged.metadata.update(a.metadata)
            elif path == "target":
                merged.target.CopyFrom(a.target)
            else:
                setattr(merged, path, getattr(a, path))
        self._check_schedule(kind, merged, paths)
        if "name" in paths and (not merged.name.strip() or len(merged.name) > _MAX_NAME):
            raise InvalidArgument(f"name must be 1 to {_MAX_NAME} characters", param="name")
        target: pb.AutomationTarget | None = None
        if "target" in paths:
            if a.target.WhichOneof("target") != automation_message(current).target.WhichOneof("target"):
                raise InvalidArgument("target.type cannot change", param="target.type")
            target = await self._check_target(org, a.target, current.creator_session_id)

        async def apply(u: Unit) -> pb.Automation:
            row = await _get(u.session, org, a.id)
            now = self.clock()
            if "run_at" in paths:
                fired = (
                    await u.session.execute(
                        select(InvocationRow.id)
                        .where(InvocationRow.automation_id == row.id, InvocationRow.scheduled_at.is_not(None))
                        .limit(1)
                    )
                ).first()
                if fired is not None or row.status == AutomationStatus.COMPLETED:
                    raise InvalidArgument("run_at cannot change after the occurrence fired", param="run_at")
                row.run_at = float(merged.run_at)
            if "name" in paths:
                row.name = merged.name
            if "metadata" in paths:
                row.metadata_json = json.dumps(dict(merged.metadata))
            if "expression" in paths:
                row.expression = merged.expression
            if "timezone" in paths:
                row.timezone = merged.timezone
            if target is not None:
                row.target_pb = target.SerializeToString()
                row.target_session_id = target.existing_session.session_id if target.HasField("existing_session") else ""
            if paths & {"expression", "timezone", "run_at"} and row.status == AutomationStatus.ACTIVE:
                row.next_run_at = _first_run(row, now)
            row.version += 1
            row.updated_at = now
            return automation_message(row)

        updated = await self.store.transact(apply)
        self.on_change()
        return updated

    async def delete(self, org: str, automation_id: str) -> str:
        async def remove(u: Unit) -> None:
            row = await _get(u.session, org, automation_id)
            await u.session.execute(delete(InvocationRow).where(InvocationRow.automation_id == row.id))
            await u.session.delete(row)

        await self.store.transact(remove)
        return automation_id

    async def pause(self, org: str, automation_id: str) -> pb.Automation:
        async def apply(u: Unit) -> pb.Automation:
            row = await _get(u.session, org, automation_id)
            if row.status == AutomationStatus.COMPLETED:
                raise FailedPrecondition("a completed automation cannot be paused", param="automation_id")
            if row.status == AutomationStatus.ACTIVE:
                row.status = AutomationStatus.PAUSED
                row.next_run_at = None
                row.version += 1
                row.updated_at = self.clock()
            return automation_message(row)

        return await self.store.transact(apply)

    async def resume(self, org: str, automation_id: str) -> pb.Automation:
        """A periodic automation continues with the first occurrence after
        now; a one-time one whose run_at passed while paused fires at once."""

        async def apply(u: Unit) -> pb.Automation:
            row = await _get(u.session, org, automation_id)
            if row.status == AutomationStatus.COMPLETED:
                raise FailedPrecondition("a completed automation cannot be resumed", param="automation_id")
            if row.status == AutomationStatus.PAUSED:
                now = self.clock()
                row.status = AutomationStatus.ACTIVE
                row.pause_reason = ""
                row.next_run_at = _first_run(row, now)
                row.version += 1
                row.updated_at = now
            return automation_message(row)

        resumed = await self.store.transact(apply)
        self.on_change()
        return resumed

    # --- invocations --------------------------------------------------------------------

    async def create_invocation(self, org: str, automation_id: str) -> pb.AutomationInvocation:
        """A manual run: queued now, delivered by the scheduler; the
        schedule does not change."""

        async def insert(u: Unit) -> pb.AutomationInvocation:
            row = await _get(u.session, org, automation_id)
            invocation = new_invocation(row, self.clock())
            u.session.add(invocation)
            await announce_invocation(u, invocation)
            return invocation_message(invocation)

        created = await self.store.transact(insert)
        self.on_change()
        return created

    async def get_invocation(self, org: str, automation_id: str, invocation_id: str) -> pb.AutomationInvocation:
        async def read(s: AsyncSession) -> InvocationRow:
            await _get(s, org, automation_id)
            row = (
                await s.execute(
                    select(InvocationRow).where(
                        InvocationRow.id == invocation_id, InvocationRow.automation_id == automation_id
                    )
                )
            ).scalar_one_or_none()
            if row is None:
                raise NotFound(f"invocation {invocation_id} not found", param="invocation_id")
            return row

        return invocation_message(await self.store.query(read))

    async def list_invocations(self, org: str, automation_id: str, page: Page) -> tuple[list[pb.AutomationInvocation], bool]:
        async def read(s: AsyncSession) -> tuple[list[InvocationRow], bool]:
            await _get(s, org, automation_id)
            return await repo.paginate(s, InvocationRow, [InvocationRow.automation_id == automation_id], page)

        rows, more = await self.store.query(read)
        return [invocation_message(r) for r in rows], more
