"""Subagents (``multi_agent``): agents a session's model creates, each a
child session on the parent's environment.

- A child session references the parent's environment (so its files and
  processes are shared, and it writes to its own
  ``/workspace/outputs/sessions/<session_id>``); it has its own history and
  turns, and its turns carry the subagent's ID as ``agent_id`` and
  ``subagent_id``. It is not listed as a session. It runs the parent's
  agent configuration (model and reasoning effort as the call asks) without
  the application function tools: nobody could answer their calls.
- The root session (the one an application created) owns every subagent of
  its tree: subagents may create subagents, and all are listed under the
  root, with ``parent_agent_id`` naming their creator. The
  ``agent.session.subagent.created/active/closed`` events go to the root's
  stream.
- ``max_concurrent_subagents`` bounds the open (not closed) subagents of a
  tree: creating or resuming one beyond it is refused, and the model is told
  to close one first. The count and the insert share one transaction that
  locks the root session's row.
- Cancelling a turn interrupts the running turns of the subagents its
  session created (``interrupt_children``, called by the runner); deleting
  a session deletes its subagents' sessions (``Sessions.delete_session``).
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from berth.session.v1 import session_pb2
from berth.session.v1 import session_service_pb2 as svc_pb
from services.core.errors import BerthError, NotFound
from services.core.ids import new_id
from services.core.logging import get_logger
from services.core.wire_json import to_message
from services.session import repository as repo
from services.session import views
from services.session.agents import DEFAULT_MAX_CONCURRENT_SUBAGENTS
from services.session.harness.subagents import SubagentPort, SubagentRefused, SubagentState
from services.session.models import ItemRow, SessionRow, SubagentRow, TurnRow
from services.session.repository import Page
from services.session.session_controls import SessionControls, budget_root
from services.session.session_input import SessionInput
from services.session.sessions import Sessions
from services.session.states import ACTIVE_TURN_STATUSES
from services.session.store import Store, Unit

__all__ = ["Subagents", "subagent_json", "subagent_message"]

log = get_logger(__name__)

ACTIVE = "active"
CLOSED = "closed"


def subagent_json(row: SubagentRow) -> dict[str, Any]:
    """`Subagent` (object ``agent.session.subagent``), as events store it."""
    return {
        "id": row.id,
        "object": "agent.session.subagent",
        "session_id": row.root_session_id,
        "parent_agent_id": row.parent_agent_id,
        "status": row.status,
        "name": row.name,
        "instructions": json.loads(row.instructions_json),
        "opened_at": int(row.opened_at),
        "closed_at": int(row.closed_at) if row.closed_at is not None else None,
    }


def subagent_message(row: SubagentRow) -> session_pb2.Subagent:
    return to_message(subagent_json(row), session_pb2.Subagent(child_session_id=row.child_session_id))


def _event(kind: str, row: SubagentRow) -> dict[str, Any]:
    return {"type": f"agent.session.subagent.{kind}", "subagent": subagent_json(row)}


def _message_event(text: str) -> svc_pb.InputEvent:
    part = session_pb2.ContentPart(type="input_text", input_text=session_pb2.InputText(text=text))
    message = svc_pb.InputMessage(role="user", content=[part])
    return svc_pb.InputEvent(type="agent.session.input.message", message=svc_pb.InputMessageEvent(input=[message]))


_CANCEL = svc_pb.InputEvent(type="agent.session.input.cancel", cancel=svc_pb.InputCancelEvent())


def _answer(item_json: str) -> str:
    item = json.loads(item_json)
    return "".join(p.get("text", "") for p in item.get("content") or () if p.get("type") == "output_text")


async def _state(s: AsyncSession, row: SubagentRow) -> SubagentState:
    turn = (
        await s.execute(
            select(TurnRow.id, TurnRow.status)
            .where(TurnRow.session_id == row.child_session_id)
            .order_by(TurnRow.pk.desc())
            .limit(1)
        )
    ).one_or_none()
    if turn is None:
        return SubagentState(row.id, row.status, False, None, None)
    running = turn.status in ACTIVE_TURN_STATUSES
    answer: str | None = None
    if not running:
        found = (
            await s.execute(
                select(ItemRow.item_json)
                .where(ItemRow.turn_id == turn.id, ItemRow.type == "message", ItemRow.visible.is_(True))
                .order_by(ItemRow.pk.desc())
                .limit(1)
            )
        ).scalar_one_or_none()
        answer = _answer(found) if found is not None and json.loads(found).get("role") == "assistant" else None
    return SubagentState(row.id, row.status, running, str(turn.status), answer)


def _bound(row: SessionRow) -> int:
    """The session's ``max_concurrent_subagents``."""
    multi_agent = views.snapshot(row)["config"].get("multi_agent") or {}
    return int(multi_agent.get("max_concurrent_subagents") or DEFAULT_MAX_CONCURRENT_SUBAGENTS)


def _full(bound: int) -> SubagentRefused:
    return SubagentRefused(f"{bound} subagents are open, the most max_concurrent_subagents allows; close one first")


async def _open_count(s: AsyncSession, root_session_id: str, *, lock: bool = True) -> int:
    if lock:
        # Locks the root's row first, so two creations in one tree count in turn.
        await s.execute(select(SessionRow.id).where(SessionRow.id == root_session_id).with_for_update())
    count = await s.execute(
        select(func.count()).select_from(SubagentRow).where(SubagentRow.root_session_id == root_session_id, SubagentRow.status == ACTIVE)
    )
    return int(count.scalar_one())


class Subagents:
    def __init__(self, store: Store, sessions: Sessions, session_input: SessionInput, *, poll_s: float = 1.0) -> None:
        self.store = store
        self.sessions = sessions
        self.input = session_input
        # Waits also re-read the children this often, should a wake-up be missed.
        self.poll_s = poll_s

    # ----- the API ---------------------------------------------------------------
    async def list_subagents(self, org: str, session_id: str, page: Page) -> tuple[list[SubagentRow], bool]:
        async def read(s: AsyncSession) -> tuple[list[SubagentRow], bool]:
            await repo.get_session(s, org, session_id)
            scope = [SubagentRow.root_session_id == session_id, SubagentRow.org_id == org]
            return await repo.paginate(s, SubagentRow, scope, page)

        return await self.store.query(read)

    async def get_subagent(self, org: str, session_id: str, subagent_id: str) -> SubagentRow:
        async def read(s: AsyncSession) -> SubagentRow:
            await repo.get_session(s, org, session_id)
            return await self.find(s, org, session_id, subagent_id)

        return await self.store.query(read)

    async def find(self, s: AsyncSession, org: str, root_session_id: str, subagent_id: str) -> SubagentRow:
        row = (
            await s.execute(
                select(SubagentRow).where(
                    SubagentRow.id == subagent_id,
                    SubagentRow.org_id == org,
                    SubagentRow.root_session_id == root_session_id,
                )
            )
        ).scalar_one_or_none()
        if row is None:
            raise NotFound(f"subagent {subagent_id} not found", param="subagent_id")
        return row

    # ----- the harness -----------------------------------------------------------
    def port(self, org: str, session_id: str, agent_id: str) -> SubagentPort:
        return _SessionSubagents(self, org, session_id, agent_id)

    async def interrupt_children(self, org: str, session_id: str) -> None:
        """Interrupts the running turns of the open subagents the session's
        model created (each one's own subagents follow when its turn ends
        cancelled)."""
        children = await self.store.query(
            lambda s: _scalars(
                s,
                select(SubagentRow.child_session_id).where(
                    SubagentRow.parent_session_id == session_id, SubagentRow.org_id == org, SubagentRow.status == ACTIVE
                ),
            )
        )
        for child in children:
            await self.interrupt_session(org, child)

    async def interrupt_session(self, org: str, child_session_id: str) -> None:
        try:
            await self.input.submit_events(org, child_session_id, [_CANCEL])
        except NotFound:
            pass  # deleted meanwhile

    async def root_of(self, org: str, session_id: str) -> str:
        async def read(s: AsyncSession) -> str:
            row = await repo.get_session(s, org, session_id)
            if row.subagent_id is None:
                return row.id
            sub = (await s.execute(select(SubagentRow.root_session_id).where(SubagentRow.id == row.subagent_id))).scalar_one()
            return str(sub)

        return await self.store.query(read)


async def _scalars(s: AsyncSession, stmt: Any) -> list[str]:
    return [str(v) for v in (await s.execute(stmt)).scalars()]


class _SessionSubagents:
    """The ``SubagentPort`` of one session's turn."""

    def __init__(self, host: Subagents, org: str, session_id: str, agent_id: str) -> None:
        self.host = host
        self.org = org
        self.session_id = session_id
        self._agent_id = agent_id
        self._root: str | None = None

    @property
    def agent_id(self) -> str:
        return self._agent_id

    async def _root_id(self) -> str:
        if self._root is None:
            self._root = await self.host.root_of(self.org, self.session_id)
        return self._root

    async def _get(self, subagent_id: str) -> SubagentRow:
        root = await self._root_id()
        try:
            return await self.host.store.query(lambda s: self.host.find(s, self.org, root, subagent_id))
        except NotFound:
            raise SubagentRefused(f"there is no subagent {subagent_id!r}") from None

    async def create(self, task: str, *, name: str | None, model: str | None, reasoning_effort: str | None) -> str:
        host = self.host
        root = await self._root_id()
        parent = await host.store.query(lambda s: repo.get_session(s, self.org, self.session_id))
        config = copy.deepcopy(views.snapshot(parent)["config"])
        # The application answers function calls on the session it knows; a
        # child session's calls would wait for an answer that never comes.
        config["tools"] = [t for t in config.get("tools") or [] if t.get("type") != "function"]
        if model:
            config["model"] = model
        if reasoning_effort:
            config["reasoning"] = {**(config.get("reasoning") or {}), "effort": reasoning_effort}
        # A subagent spends its tree's budget, so its model must be priced.
        budgeted = await host.store.query(lambda s: budget_root(s, parent))
        if SessionControls.from_json(budgeted.controls_json).spend_limit_cents is not None:
            if host.input.prices.price(str(config.get("model") or "")) is None:
                raise SubagentRefused(
                    f"model {config.get('model')!r} has no price (BERTH_MODEL_PRICES), and this session has a spend_control limit"
                )
        bound = _bound(parent)
        # A first look, so a refusal does not attach the environment.
        if await host.store.query(lambda s: _open_count(s, root, lock=False)) >= bound:
            raise _full(bound)
        now = time.time()
        row = SubagentRow(
            id=new_id("subagent"),
            org_id=self.org,
            root_session_id=root,
            parent_session_id=self.session_id,
            parent_agent_id=self._agent_id,
            child_session_id=new_id("sess"),
            name=name,
            instructions_json=json.dumps([{"type": "output_text", "text": task}]),
            status=ACTIVE,
            opened_at=now,
            closed_at=None,
        )

        async def record(u: Unit) -> None:
            if await _open_count(u.session, root) >= bound:
                raise _full(bound)
            u.session.add(row)
            await u.emit(root, _event("created", row))

        environment = (
            svc_pb.SessionEnvironment(environment_id=parent.environment_id)
            if parent.environment_kind == "hosted"
            else svc_pb.SessionEnvironment(none=svc_pb.NoEnvironment())
        )
        try:
            await host.sessions.create_with_config(
                self.org,
                agent_id=row.id,
                name=name,
                config=config,
                environment=environment,
                messages=[[{"type": "input_text", "text": task}]],
                metadata={},
                vault_ids=json.loads(parent.vault_ids_json),
                session_id=row.child_session_id,
                subagent_id=row.id,
                also=record,
            )
        except BerthError as exc:
            raise SubagentRefused(f"the subagent could not be created: {exc.message}") from exc
        log.info("subagent_created", subagent_id=row.id, child_session_id=row.child_session_id)
        return row.id

    async def send_input(self, subagent_id: str, text: str) -> None:
        row = await self._get(subagent_id)
        if row.status != ACTIVE:
            raise SubagentRefused(f"subagent {subagent_id} is closed; resume it first")
        await self.host.input.submit_events(self.org, row.child_session_id, [_message_event(text)])

    async def wait(self, subagent_ids: list[str], timeout_s: float) -> list[SubagentState]:
        rows = [await self._get(i) for i in dict.fromkeys(subagent_ids)]
        store = self.host.store
        feeds = [(r.child_session_id, store.feeds.subscribe(r.child_session_id)) for r in rows]
        deadline = asyncio.get_running_loop().time() + timeout_s
        try:
            while True:
                for _, feed in feeds:
                    feed.wake.clear()
                states = await store.query(lambda s: _states(s, rows))
                remaining = deadline - asyncio.get_running_loop().time()
                if not any(st.running for st in states) or remaining <= 0:
                    return states
                waits = [asyncio.create_task(feed.wake.wait()) for _, feed in feeds]
                try:
                    await asyncio.wait(waits, timeout=min(remaining, self.host.poll_s), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in waits:
                        w.cancel()
        finally:
            for session_id, feed in feeds:
                store.feeds.unsubscribe(session_id, feed)

    async def interrupt(self, subagent_id: str) -> None:
        row = await self._get(subagent_id)
        await self.host.interrupt_session(self.org, row.child_session_id)

    async def resume(self, subagent_id: str) -> None:
        row = await self._get(subagent_id)
        bound = _bound(await self.host.store.query(lambda s: repo.get_session(s, self.org, self.session_id)))

        async def reopen(u: Unit) -> None:
            if await _open_count(u.session, row.root_session_id) >= bound:
                raise _full(bound)
            changed = await self._transition(u, row, CLOSED, ACTIVE, None)
            if not changed:
                raise SubagentRefused(f"subagent {subagent_id} is not closed")
            await u.emit(row.root_session_id, _event("active", row))

        await self.host.store.transact(reopen)

    async def close(self, subagent_id: str) -> None:
        row = await self._get(subagent_id)

        async def shut(u: Unit) -> None:
            if not await self._transition(u, row, ACTIVE, CLOSED, time.time()):
                raise SubagentRefused(f"subagent {subagent_id} is already closed")
            await u.emit(row.root_session_id, _event("closed", row))

        await self.host.store.transact(shut)
        await self.host.interrupt_session(self.org, row.child_session_id)

    async def _transition(self, u: Unit, row: SubagentRow, expected: str, status: str, closed_at: float | None) -> bool:
        result = await u.session.execute(
            update(SubagentRow)
            .where(SubagentRow.id == row.id, SubagentRow.status == expected)
            .values(status=status, closed_at=closed_at)
        )
        if int(getattr(result, "rowcount", 0)) != 1:
            return False
        row.status, row.closed_at = status, closed_at
        return True


async def _states(s: AsyncSession, rows: list[SubagentRow]) -> list[SubagentState]:
    out = []
    for row in rows:
        current = (await s.execute(select(SubagentRow.status).where(SubagentRow.id == row.id))).scalar_one_or_none()
        if current is not None:
            row.status = current
        out.append(await _state(s, row))
    return out
