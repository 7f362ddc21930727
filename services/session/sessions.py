"""Sessions: create (snapshotting the agent and binding the environment),
read, list, update and delete, scoped by the caller's organization
(``current_org()``); another organization's session is ``NotFound``."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, exists, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from berth.environment.v1 import environment_pb2
from berth.session.v1 import session_service_pb2 as svc_pb
from services.core.errors import BerthError, FailedPrecondition, InvalidArgument, NotFound, SessionActive
from services.core.ids import new_id
from services.core.logging import get_logger
from services.session import repository as repo
from services.session import views, wire
from services.session.agents import AgentConfig, apply_config, new_config
from services.session.session_controls import SessionControls, budget_move
from services.session.artifacts import BlobStore
from services.session.environment_client import EnvironmentClient
from services.session.mcp_connections import McpConnections
from services.session.models import SessionRow, TurnRow
from services.session.repository import Page
from services.session.runner import TurnRunner
from services.session.saved_agents import config_paths
from services.session.session_input import enqueue_turn, input_messages
from services.session.states import RUNNING_TURN_STATUSES, SessionStatus, TurnStatus
from services.session.store import Store, Unit

__all__ = ["Sessions", "CreatedSession"]

log = get_logger(__name__)


@dataclass
class CreatedSession:
    view: views.SessionView
    turn_id: str
    created_sequence: int


class Sessions:
    def __init__(
        self,
        store: Store,
        env_client: EnvironmentClient | None,
        runner: TurnRunner,
        blobs: BlobStore,
        mcp: McpConnections | None = None,
    ) -> None:
        self.store = store
        self.env = env_client
        self.runner = runner
        self.blobs = blobs
        self.mcp = mcp

    async def _environment(self, row: SessionRow) -> environment_pb2.Environment | None:
        if row.environment_kind != "hosted" or self.env is None:
            return None
        try:
            return await self.env.get_environment(row.environment_id)
        except BerthError as exc:
            log.warning("environment_lookup_failed", environment_id=row.environment_id, reason=exc.reason)
            return None

    async def _bind_environment(
        self, env_param: svc_pb.SessionEnvironment, session_id: str, vault_ids: list[str]
    ) -> tuple[str, str, environment_pb2.Environment | None]:
        """Returns (kind, environment_id, environment) after creating or attaching."""
        kind = env_param.WhichOneof("environment")
        if kind in (None, "none"):
            return "none", "", None
        if self.env is None:
            raise FailedPrecondition("no environment service is configured", param="environment")
        if kind == "environment_id":
            environment_id = env_param.environment_id
            if not environment_id:
                raise InvalidArgument("environment.environment_id is required", param="environment.environment_id")
            environment = await self.env.attach_session(environment_id, session_id)
            return "hosted", environment.id or environment_id, environment
        environment = await self.env.create_environment(env_param.inline, vault_ids=vault_ids, owner_session_id=session_id)
        return "hosted", environment.id, environment

    async def create_session(self, org: str, request: svc_pb.CreateSessionRequest) -> CreatedSession:
        """Snapshots the saved agent with the given overrides (the fields of
        ``agent_mask``), or the inline agent, and binds the environment."""
        agent_id = request.agent_id
        name: str | None = None
        if agent_id:
            saved_id = agent_id
            saved = await self.store.query(lambda s: repo.get_agent(s, org, saved_id))
            name = saved.name
            config = apply_config(
                json.loads(saved.config_json), request.agent, set(request.agent_mask.paths), prefix="agent", persisted=False
            )
        else:
            agent_id = new_id("agent")
            config = new_config(request.agent, prefix="agent", persisted=False)
        controls = SessionControls.from_proto(request.controls)
        controls.check_priced(self.runner.prices, str(config.get("model") or ""))
        return await self.create_with_config(
            org,
            agent_id=agent_id,
            name=name,
            config=config,
            environment=request.environment,
            messages=input_messages(request.input),
            metadata=dict(request.metadata),
            vault_ids=list(request.vault_ids),
            controls=controls,
        )

    async def create_with_config(
        self,
        org: str,
        *,
        agent_id: str,
        name: str | None,
        config: AgentConfig,
        environment: svc_pb.SessionEnvironment,
        messages: list[list[dict[str, Any]]],
        metadata: dict[str, str],
        vault_ids: list[str],
        controls: SessionControls | None = None,
        session_id: str = "",
        subagent_id: str | None = None,
        also: Callable[[Unit], Awaitable[None]] | None = None,
    ) -> CreatedSession:
        """Creates a session with a resolved configuration and binds its
        environment; ``also`` runs in the inserting transaction (a subagent's
        row and event go with its child session)."""
        session_id = session_id or new_id("sess")
        if vault_ids and environment.WhichOneof("environment") != "inline":
            # An inline environment checks them itself (they become its selection).
            if self.env is None:
                raise FailedPrecondition("vaults need the environment service, which is not configured", param="vault_ids")
            await self.env.check_vaults(vault_ids)
        kind, environment_id, env = await self._bind_environment(environment, session_id, vault_ids)
        now = time.time()
        row = SessionRow(
            id=session_id,
            org_id=org,
            agent_id=agent_id,
            agent_config_json=json.dumps({"id": agent_id, "name": name, "config": config}),
            environment_kind=kind,
            environment_id=environment_id,
            status=SessionStatus.IDLE,
            error="",
            metadata_json=json.dumps(metadata),
            vault_ids_json=json.dumps(vault_ids),
            usage_json="",
            controls_json=(controls or SessionControls()).to_json(),
            created_at=now,
            last_active_at=now,
            event_seq=0,
            active_turn_id=None,
            subagent_id=subagent_id,
        )

        async def insert(u: Unit) -> tuple[views.SessionView, int, str]:
            u.session.add(row)
            await repo.replace_session_metadata(u.session, org, session_id, metadata)
            await u.session.flush()
            # An environment whose setup already failed shows on the new session at once.
            view = await views.session_view(u.session, row, env, prices=self.runner.prices)
            (created,) = await u.emit(session_id, wire.session_event("agent.session.created", view.message))
            turn_id = await enqueue_turn(u, row, messages) if messages else ""
            if also is not None:
                await also(u)
            return view, created.sequence, turn_id

        try:
            view, created_sequence, turn_id = await self.store.transact(insert)
        except BaseException:
            if kind == "hosted" and self.env is not None:
                await self._detach_quietly(environment_id, session_id)
            raise
        if turn_id:
            self.runner.kick(session_id, org)
        log.info("session_created", session_id=session_id, environment_id=environment_id or None)
        return CreatedSession(view, turn_id, created_sequence)

    async def _detach_quietly(self, environment_id: str, session_id: str) -> None:
        assert self.env is not None
        try:
            await asyncio.shield(self.env.detach_session(environment_id, session_id))
        except Exception:
            log.warning("environment_detach_failed", environment_id=environment_id, session_id=session_id, exc_info=True)

    async def get_session(self, org: str, session_id: str) -> views.SessionView:
        row = await self.store.query(lambda s: repo.get_session(s, org, session_id))
        environment = await self._environment(row)
        return await self.store.query(lambda s: views.session_view(s, row, environment, prices=self.runner.prices))

    async def list_sessions(
        self, org: str, page: Page, agent_id: str = "", metadata: dict[str, str] | None = None
    ) -> tuple[list[views.SessionView], bool]:
        # A subagent's child session is listed as a subagent, not as a session.
        scope = [SessionRow.org_id == org, SessionRow.status != SessionStatus.DELETING, SessionRow.subagent_id.is_(None)]
        if agent_id:
            scope.append(SessionRow.agent_id == agent_id)
        scope.extend(repo.metadata_filter(org, metadata or {}))
        rows, more = await self.store.query(lambda s: repo.paginate(s, SessionRow, scope, page))
        environments = await asyncio.gather(*(self._environment(r) for r in rows))

        async def render(s: AsyncSession) -> list[views.SessionView]:
            return [
                await views.session_view(s, r, e, prices=self.runner.prices)
                for r, e in zip(rows, environments, strict=True)
            ]

        return await self.store.query(render), more

    async def update_session(self, org: str, request: svc_pb.UpdateSessionRequest) -> views.SessionView:
        """Changes the fields named in the update mask."""
        session_id = request.session_id
        paths = set(request.update_mask.paths)
        agent_paths = config_paths(paths, "agent.")

        # A changed budget may pause or resume the session, whose event shows it
        # with its environment (read before the transaction, not inside it).
        environment = None
        if paths & {"spend_control", "vault_ids"}:
            current = await self.store.query(lambda s: repo.get_session(s, org, session_id))
            if "spend_control" in paths:
                environment = await self._environment(current)
            if "vault_ids" in paths:
                await self._check_new_vaults(current, list(request.vault_ids))
        resumed = False

        async def update_row(u: Unit) -> None:
            nonlocal resumed
            row = await repo.get_session(u.session, org, session_id)
            if "vault_ids" in paths:
                row.vault_ids_json = json.dumps(list(request.vault_ids))
            if "metadata" in paths:
                row.metadata_json = json.dumps(dict(request.metadata))
                await repo.replace_session_metadata(u.session, org, session_id, dict(request.metadata))
            if agent_paths:
                snap = views.snapshot(row)
                snap["config"] = apply_config(snap["config"], request.agent, agent_paths, prefix="agent", persisted=False)
                row.agent_config_json = json.dumps(snap)
            if paths & {"review", "spend_control", "prompt_cache_options"} or agent_paths:
                controls = SessionControls.from_json(row.controls_json).updated(request.controls, paths)
                controls.check_priced(self.runner.prices, str(views.snapshot(row)["config"].get("model") or ""))
                row.controls_json = controls.to_json()
            if "spend_control" in paths:
                await u.session.flush()
                moved = await budget_move(u.session, row, self.runner.prices)
                # Only while no turn took the session meanwhile (a claim sets in_progress).
                if moved is not None and await repo.move_idle_session(u.session, session_id, row.status, moved):
                    view = await views.session_view(u.session, row, environment, prices=self.runner.prices, status=moved)
                    await u.emit(session_id, wire.session_event(f"agent.session.{moved}", view.message))
                    resumed = moved == SessionStatus.IDLE

        await self.store.transact(update_row)
        if resumed:
            # Turns queued before the pause run now.
            self.runner.kick(session_id, org)
        return await self.get_session(org, session_id)

    async def _check_new_vaults(self, row: SessionRow, vault_ids: list[str]) -> None:
        """A session's vaults may change when they give its own MCP
        connections their credentials alone. The vaults of a session that
        created its environment inline also select that environment's
        secrets, which its sandbox fixed at creation: those cannot change."""
        if row.environment_kind == "hosted":
            if self.env is None:
                raise FailedPrecondition("no environment service is configured", param="vault_ids")
            environment = await self.env.get_environment(row.environment_id)
            if environment.owner_session_id == row.id and set(vault_ids) != set(environment.vault_ids):
                raise InvalidArgument(
                    "vault_ids cannot change on a session that created its environment inline: they also select"
                    " the environment's secrets, fixed when its sandbox was made; create a new session instead",
                    param="vault_ids",
                )
        if vault_ids:
            if self.env is None:
                raise FailedPrecondition("vaults need the environment service, which is not configured", param="vault_ids")
            await self.env.check_vaults(vault_ids)

    async def delete_session(self, org: str, session_id: str) -> str:
        """Refuses while a turn of the session, or of one of its subagents,
        is running, or queued on a session that is not paused at its budget
        (a paused one's queued turns are deleted with it). Deletes the subagents' child sessions first,
        then the session. For each: detaches the environment (a never-shared
        private one is deleted with its sandbox by the Environment service; a
        shared one closes the upstream of every HTTP MCP label the session
        used, even though peers share it), closes the session's own MCP
        connections, then deletes turns, items, events and artifacts. Stdio
        MCP servers keep running."""

        async def mark(u: Unit) -> list[tuple[SessionRow, str]]:
            row = await repo.get_session(u.session, org, session_id)
            tree = [row]
            for child_id in await repo.descendant_sessions(u.session, session_id):
                child = (await u.session.execute(select(SessionRow).where(SessionRow.id == child_id))).scalar_one_or_none()
                if child is not None:
                    tree.append(child)
            ids = [r.id for r in tree]
            # A session paused at its budget holds its queued turns: they go with it.
            running = [r.id for r in tree if r.status != SessionStatus.BUDGET_REACHED]
            busy = (
                await u.session.execute(
                    select(
                        exists().where(
                            or_(
                                and_(TurnRow.session_id.in_(ids), TurnRow.status.in_(RUNNING_TURN_STATUSES)),
                                and_(TurnRow.session_id.in_(running), TurnRow.status == TurnStatus.QUEUED),
                            )
                        )
                    )
                )
            ).scalar()
            if busy or any(r.active_turn_id is not None for r in tree):
                raise SessionActive(
                    f"session {session_id} or one of its subagents has a turn in progress; cancel it first",
                    param="session_id",
                )
            marked = [(r, r.status) for r in tree]
            for r in tree:
                # New input is refused from here on (the session reads as absent).
                r.status = SessionStatus.DELETING
            return marked

        marked = await self.store.transact(mark)
        # Children first: the deepest were found last.
        for row, previous_status in reversed(marked):
            await self._remove(row, previous_status)
        return session_id

    async def _remove(self, row: SessionRow, previous_status: str) -> None:
        session_id = row.id
        if row.environment_kind == "hosted" and self.env is not None:
            try:
                await self.env.detach_session(row.environment_id, session_id)
            except BerthError as exc:
                if not isinstance(exc, NotFound):

                    async def restore(u: Unit) -> None:
                        await u.session.execute(
                            update(SessionRow).where(SessionRow.id == session_id).values(status=previous_status)
                        )

                    await self.store.transact(restore)
                    raise
        if self.mcp is not None:
            await self.mcp.close_session(session_id)
        self.runner.forget(session_id)

        async def remove(u: Unit) -> list[str]:
            shas = await repo.delete_session_rows(u.session, session_id)
            u.wake_key(f"events:{session_id}")
            return await repo.unreferenced_blobs(u.session, shas)

        self.blobs.delete(await self.store.transact(remove))
        log.info("session_deleted", session_id=session_id)
