"""Runs turns: one worker task per session with queued work, one turn at a
time per session, inside this service process.

- Claiming a turn is a compare-and-set on ``sessions.active_turn_id`` (the
  per-session mutex), so replicas never run two turns of one session. The
  claim starts the turn in the same transaction (its user items and start
  events) and reads what the harness needs (agent snapshot, transcript).
  Input that reaches an idle session whose environment is known (none, or
  ready: ``EnvironmentCache``) starts its turn in the submitting transaction
  itself (``start_in``); otherwise a worker claims it.
- The worker owning a turn renews a lease on it. A cancel from another
  replica sets ``turns.cancel_requested``, which the owner polls; a turn whose
  lease expired (its replica died) is failed by any replica's sweeper, which
  also restarts sessions whose queue was left without a worker.
- Finishing a turn is one transaction: the terminal status is written with a
  compare-and-set from ``in_progress``/``waiting``, so a completed or failed
  outcome is never replaced by a cancel (and vice versa). Artifacts of a
  completed turn are recorded in that same transaction; its outputs are read
  while the final answer is written. The same transaction tells the worker
  whether another turn is queued.
- Disconnecting clients do not affect any of this: turns live in this task.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, cast

import structlog
from sqlalchemy import Table, bindparam, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from berth.environment.v1 import environment_pb2
from services.core.context import org_id_var
from services.core.errors import BerthError
from services.core.ids import new_id
from services.core.logging import get_logger
from services.session import repository as repo
from services.session import views, wire
from services.session.artifacts import BlobStore, OutputFile, collect_outputs, published_state, record_publication
from services.session.environment_cache import EnvironmentCache
from services.session.environment_client import EnvironmentClient
from services.session.harness.io import TurnFailure
from services.session.harness.loop import run_turn
from services.session.harness.models import ProviderRegistry
from services.session.harness.models.base import Entry
from services.session.mcp_connections import McpConnections
from services.session.models import FunctionCallRow, ItemRow, SessionRow, TurnRow
from services.session.store import Store, Unit
from services.session.turn_io import DbTurnIO

__all__ = ["TurnRunner", "Outcome", "ClaimedTurn"]

log = get_logger(__name__)

_ITEMS = cast(Table, ItemRow.__table__)
# Built once (see services/session/repository.py on prepared statements).
_HISTORY = select(_ITEMS.c.id, _ITEMS.c.model_json).where(_ITEMS.c.session_id == bindparam("session_id")).order_by(_ITEMS.c.pk)
_INSERT_ITEMS = insert(_ITEMS)


@dataclass(frozen=True)
class Outcome:
    status: str  # completed | failed | cancelled
    code: str = ""
    message: str = ""


@dataclass
class ClaimedTurn:
    """A turn this worker has started (it holds the session's mutex)."""

    org_id: str
    session_id: str
    turn_id: str
    environment_id: str | None
    environment: environment_pb2.Environment | None
    # Read with the claim for the harness: the session's agent snapshot and
    # the model-facing entries of its items so far, by item.
    agent_config_json: str = ""
    transcript: list[tuple[str, list[Entry]]] = field(default_factory=list)
    # The session's usage when the turn started.
    usage_json: str = ""


class TurnRunner:
    def __init__(
        self,
        store: Store,
        env_client: EnvironmentClient | None,
        providers: ProviderRegistry,
        blobs: BlobStore,
        *,
        mcp: McpConnections | None = None,
        lease_s: float = 30.0,
        poll_s: float = 0.5,
        sweep_s: float = 5.0,
    ) -> None:
        self.store = store
        self.env_client = env_client
        self.providers = providers
        self.blobs = blobs
        self.mcp = mcp
        self.environments = EnvironmentCache(env_client)
        self.worker_id = f"w_{secrets.token_hex(8)}"
        self.lease_s = lease_s
        self.poll_s = poll_s
        self.sweep_s = sweep_s
        self._loops: dict[str, asyncio.Task[None]] = {}
        self._dirty: set[str] = set()
        self._turns: dict[str, asyncio.Task[None]] = {}
        # Turns started inside another transaction, waiting for their worker.
        self._started: dict[str, ClaimedTurn] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._closing = False

    # ----- lifecycle --------------------------------------------------------------
    async def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="session-turn-sweeper")

    async def close(self) -> None:
        self._closing = True
        tasks = [t for t in [self._sweeper, *self._loops.values()] if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.environments.close()

    # ----- scheduling -------------------------------------------------------------
    def kick(self, session_id: str, org_id: str) -> None:
        """Makes sure a worker looks for queued turns of the session."""
        if self._closing:
            return
        self._dirty.add(session_id)
        task = self._loops.get(session_id)
        if task is None or task.done():
            self._loops[session_id] = asyncio.create_task(
                self._session_loop(session_id, org_id), name=f"session-worker-{session_id}"
            )

    def cancel_local(self, turn_id: str) -> bool:
        task = self._turns.get(turn_id)
        if task is None or task.done():
            return False
        task.cancel()
        return True

    async def start_in(self, u: Unit, org_id: str, session_id: str) -> ClaimedTurn | None:
        """Starts the session's oldest queued turn inside the caller's
        transaction (e.g. the one that queued it), when that needs no call
        to the Environment service: its environment is known to be none or
        ready. After commit, ``run_started`` runs it; otherwise ``kick``."""
        known = self.environments.get(session_id)
        if known is None or self._closing:
            return None
        await u.session.flush()
        return await self._start_next(u, org_id, session_id, known.environment_id, known.environment)

    def run_started(self, claimed: ClaimedTurn) -> None:
        """Runs a turn ``start_in`` started, once its transaction committed."""
        self._started[claimed.session_id] = claimed
        self.kick(claimed.session_id, claimed.org_id)

    def forget(self, session_id: str) -> None:
        """The session is gone: drop what is known about it."""
        self.environments.forget(session_id)

    def is_running(self, turn_id: str) -> bool:
        task = self._turns.get(turn_id)
        return task is not None and not task.done()

    async def _session_loop(self, session_id: str, org_id: str) -> None:
        org_id_var.set(org_id)
        try:
            while True:
                self._dirty.discard(session_id)
                claimed = await self._claim(session_id, org_id)
                if claimed is not None and await self._run(claimed):
                    continue
                # No await between this check and the exit below, so a kick
                # can never be lost in between.
                if session_id in self._dirty:
                    continue
                return
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("session_worker_failed", session_id=session_id)
        finally:
            if self._loops.get(session_id) is asyncio.current_task():
                del self._loops[session_id]

    async def _environment(self, environment_id: str | None) -> environment_pb2.Environment | None:
        if not environment_id or self.env_client is None:
            return None
        try:
            return await self.env_client.get_environment(environment_id)
        except BerthError as exc:
            log.warning("environment_lookup_failed", environment_id=environment_id, reason=exc.reason)
            return None

    async def _claim(self, session_id: str, org_id: str) -> ClaimedTurn | None:
        started = self._started.pop(session_id, None)
        if started is not None:
            return started
        known = self.environments.get(session_id)
        if known is not None:
            environment_id, environment = known.environment_id, known.environment
        else:

            async def runnable(s: AsyncSession) -> SessionRow | None:
                row = (await s.execute(select(SessionRow).where(SessionRow.id == session_id))).scalar_one_or_none()
                if row is None or row.active_turn_id is not None or not await repo.has_queued_turn(s, session_id):
                    return None
                return row

            row = await self.store.query(runnable)
            if row is None:
                return None
            environment_id = row.environment_id if row.environment_kind == "hosted" else None
            environment = await self._environment(environment_id)
            self.environments.remember(session_id, environment_id, environment)
        return await self.store.transact(lambda u: self._start_next(u, org_id, session_id, environment_id, environment))

    async def _start_next(
        self,
        u: Unit,
        org_id: str,
        session_id: str,
        environment_id: str | None,
        environment: environment_pb2.Environment | None,
    ) -> ClaimedTurn | None:
        """Takes the session's mutex for its oldest queued turn and starts it:
        the turn's user messages become items now, in conversation order."""
        now = time.time()
        turn = await repo.queued_turn(u.session, session_id)
        if turn is None:
            return None
        inputs: list[list[dict[str, Any]]] = json.loads(turn.input_json or "[]")
        # The claim also allocates the sequence numbers of the events below.
        row = await repo.claim_active_turn(u.session, session_id, turn.id, now, events=2 + len(inputs))
        if row is None:
            return None
        started = {
            "status": "in_progress",
            "started_at": now,
            "worker_id": self.worker_id,
            "lease_expires_at": now + self.lease_s,
        }
        await repo.set_turn_status(u.session, turn.id, ("queued",), **started)
        for key, value in started.items():
            setattr(turn, key, value)
        # Items are only added by the active turn, so this is the whole history.
        history = await u.session.execute(_HISTORY, {"session_id": session_id})
        transcript: list[tuple[str, list[Entry]]] = [(item_id, json.loads(model_json)) for item_id, model_json in history]
        # No turn is waiting for function results: there are no required actions.
        view = await views.session_view(u.session, row, environment, status="in_progress", actions=[])
        events = [
            wire.turn_event("agent.session.turn.in_progress", views.turn_json(turn)),
            wire.session_event("agent.session.in_progress", view.wire),
        ]
        rows: list[dict[str, Any]] = []
        for parts in inputs:
            item_id = new_id("item")
            item = {
                "type": "message",
                "id": item_id,
                "role": "user",
                "status": "completed",
                "phase": None,
                "content": parts,
                "turn_id": turn.id,
            }
            entries: list[Entry] = [{"role": "user", "text": views.message_text(parts)}]
            rows.append(
                {
                    "id": item_id,
                    "session_id": session_id,
                    "turn_id": turn.id,
                    "type": "message",
                    "item_json": json.dumps(item),
                    "model_json": json.dumps(entries),
                    "visible": True,
                    "created_at": now,
                }
            )
            transcript.append((item_id, entries))
            events.append({"type": "agent.session.turn.item.added", "session_id": session_id, "turn_id": turn.id, "item": item})
        if rows:
            await u.session.execute(_INSERT_ITEMS, rows)
        u.append(session_id, row.event_seq, *events)
        return ClaimedTurn(
            org_id, session_id, turn.id, environment_id, environment, row.agent_config_json, transcript, row.usage_json
        )

    # ----- running ----------------------------------------------------------------
    async def _run(self, claimed: ClaimedTurn) -> bool:
        """Runs the claimed turn to its end; returns whether the session may
        have another queued turn."""
        # Every log line of the turn (its task inherits this context) names it.
        structlog.contextvars.bind_contextvars(
            org_id=claimed.org_id,
            session_id=claimed.session_id,
            turn_id=claimed.turn_id,
            environment_id=claimed.environment_id,
        )
        # Reading the outputs starts once the model has answered, while the
        # answer is written.
        collecting: list[asyncio.Task[list[OutputFile]]] = []

        def start_collecting() -> None:
            if not collecting:
                collecting.append(asyncio.create_task(self._collect(claimed, io)))

        io = DbTurnIO(
            self.store,
            self.env_client,
            org_id=claimed.org_id,
            session_id=claimed.session_id,
            turn_id=claimed.turn_id,
            environment_id=claimed.environment_id,
            environment=claimed.environment,
            agent_config_json=claimed.agent_config_json,
            transcript=claimed.transcript,
            mcp=self.mcp,
            on_ending=start_collecting,
        )
        task = asyncio.create_task(run_turn(io, self.providers.for_model), name=f"turn-{claimed.turn_id}")
        self._turns[claimed.turn_id] = task
        watcher = asyncio.create_task(self._watch(claimed.turn_id, task))
        try:
            try:
                await asyncio.wait({task})
            except asyncio.CancelledError:
                # The service is stopping: end the turn rather than leave it to the lease.
                task.cancel()
                await asyncio.wait({task})
                await io.settle()
                await asyncio.shield(
                    self._finalize(
                        claimed, io, Outcome("failed", "internal_error", "the session service stopped"), collecting
                    )
                )
                raise
        finally:
            watcher.cancel()
            self._turns.pop(claimed.turn_id, None)
        await io.settle()
        if task.cancelled():
            outcome = Outcome("cancelled")
        elif isinstance(task.exception(), TurnFailure):
            failure = task.exception()
            assert isinstance(failure, TurnFailure)
            outcome = Outcome("failed", failure.code, failure.message)
        elif task.exception() is not None:
            log.error("turn_crashed", turn_id=claimed.turn_id, exc_info=task.exception())
            outcome = Outcome("failed", "internal_error", "an internal error ended the turn")
        else:
            outcome = Outcome("completed")
        return await asyncio.shield(self._finalize(claimed, io, outcome, collecting))

    async def _watch(self, turn_id: str, task: asyncio.Task[None]) -> None:
        """Polls for cancels sent to other replicas (and for the turn having
        been ended elsewhere, e.g. by a sweeper) and renews the lease."""
        renewed = time.monotonic()
        while not task.done():
            await asyncio.sleep(self.poll_s)
            try:
                if await self.store.query(lambda s: self._should_stop(s, turn_id)):
                    task.cancel()
                    return
                if time.monotonic() - renewed > self.lease_s / 3:
                    await self.store.transact(lambda u: self._renew(u, turn_id))
                    renewed = time.monotonic()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("turn_watch_failed", turn_id=turn_id, exc_info=True)

    async def _should_stop(self, s: AsyncSession, turn_id: str) -> bool:
        row = (await s.execute(select(TurnRow.cancel_requested, TurnRow.status).where(TurnRow.id == turn_id))).one_or_none()
        return row is None or bool(row[0]) or row[1] not in ("in_progress", "waiting")

    async def _renew(self, u: Unit, turn_id: str) -> None:
        await u.session.execute(
            update(TurnRow)
            .where(TurnRow.id == turn_id, TurnRow.worker_id == self.worker_id)
            .values(lease_expires_at=time.time() + self.lease_s)
        )

    async def _collect(self, claimed: ClaimedTurn, io: DbTurnIO | None) -> list[OutputFile]:
        if not claimed.environment_id or self.env_client is None:
            return []
        if io is None or not io.environment_ready:
            env = await self.env_client.get_environment(claimed.environment_id)
            if env.status != environment_pb2.ENVIRONMENT_STATUS_READY:
                return []
        return await collect_outputs(
            self.env_client,
            self.blobs,
            lambda: self.store.query(lambda s: published_state(s, claimed.session_id)),
            session_id=claimed.session_id,
            environment_id=claimed.environment_id,
        )

    async def _finalize(
        self,
        claimed: ClaimedTurn,
        io: DbTurnIO | None,
        outcome: Outcome,
        collecting: list[asyncio.Task[list[OutputFile]]] | None = None,
    ) -> bool:
        """Ends the turn in one transaction; returns whether the session may
        have another queued turn. ``collecting`` holds the task that reads
        the turn's outputs when it was started early."""
        files: list[OutputFile] = []
        if outcome.status == "completed":
            try:
                files = await (collecting[0] if collecting else self._collect(claimed, io))
            except BerthError as exc:
                failure = io.sandbox_failure(exc) if io is not None else TurnFailure("sandbox_error", exc.message)
                outcome = Outcome("failed", "sandbox_error", f"publishing outputs failed: {failure.message}")
        elif collecting:
            # The turn ended otherwise after its outputs were read: nothing is
            # published, and the blobs read are removed below.
            try:
                files = await collecting[0]
            except Exception:
                log.warning("turn_outputs_dropped", session_id=claimed.session_id, turn_id=claimed.turn_id, exc_info=True)
        environment = io.environment if io is not None else claimed.environment
        usage = io.usage if io is not None else None
        recorded = False

        async def finish(u: Unit) -> bool:
            nonlocal recorded
            now = time.time()
            values: dict[str, Any] = {}
            if io is not None:
                values["next_output_index"] = io.next_output_index
            turn = await repo.transition_turn(
                u.session,
                claimed.turn_id,
                ("in_progress", "waiting"),
                status=outcome.status,
                completed_at=now,
                error_code=outcome.code,
                error_message=outcome.message,
                usage_json=json.dumps(usage) if usage is not None else "",
                **values,
            )
            if turn is None:
                # Ended elsewhere (a sweeper); whoever did that restarts the queue too.
                return True
            if io is not None and outcome.status != "completed":
                await io.close_open_items(u)
            if io is None or io.made_function_calls:
                await u.session.execute(
                    update(FunctionCallRow)
                    .where(FunctionCallRow.turn_id == claimed.turn_id, FunctionCallRow.state.in_(("pending", "answered")))
                    .values(state="cancelled")
                )
            if outcome.status == "completed" and files:
                await record_publication(
                    u.session,
                    files,
                    org_id=claimed.org_id,
                    session_id=claimed.session_id,
                    turn_id=claimed.turn_id,
                    environment_id=str(claimed.environment_id),
                )
                recorded = True
            session_usage = None
            if usage is not None:
                # Only the turn holding the mutex changes the session's usage,
                # so what the claim read is still current.
                session_usage = wire.add_usage(wire.parse_usage(claimed.usage_json), usage)
            events_count = 3 if outcome.status == "failed" else 2
            released = await repo.release_active_turn(
                u.session,
                claimed.session_id,
                claimed.turn_id,
                now,
                events=events_count,
                usage_json=json.dumps(session_usage) if session_usage is not None else None,
            )
            if released is None:
                row, more = await repo.get_session(u.session, claimed.org_id, claimed.session_id), True
                status = "failed" if row.error else "idle"
            else:
                row, more = released
                status = row.status
            # The turn's function calls were cancelled above, so none is required.
            view = await views.session_view(u.session, row, environment, status=status, actions=[])
            events = []
            if outcome.status == "failed":
                events.append(wire.error_event(claimed.session_id, outcome.code, outcome.code, outcome.message))
            events.append(wire.turn_event(f"agent.session.turn.{outcome.status}", views.turn_json(turn), with_usage=True))
            events.append(wire.session_event(f"agent.session.{status}", view.wire))
            if released is not None:
                u.append(claimed.session_id, row.event_seq, *events)
            else:
                await u.emit(claimed.session_id, *events)
            u.wake_key(f"calls:{claimed.turn_id}")
            return more

        try:
            more = await self.store.transact(finish)
        finally:
            if files and not recorded:
                shas = sorted({f.sha256 for f in files})
                self.blobs.delete(await self.store.query(lambda s: repo.unreferenced_blobs(s, shas)))
        if outcome.code == "sandbox_error":
            self.environments.forget(claimed.session_id)
        elif io is not None and io.environment is not claimed.environment:
            # The turn read the environment itself (e.g. it waited for setup).
            self.environments.remember(claimed.session_id, claimed.environment_id, io.environment)
        log.info("turn_finished", session_id=claimed.session_id, turn_id=claimed.turn_id, status=outcome.status, code=outcome.code)
        return more

    # ----- recovery ---------------------------------------------------------------
    async def _sweep_loop(self) -> None:
        while True:
            try:
                await self.sweep()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("turn_sweep_failed", exc_info=True)
            await asyncio.sleep(self.sweep_s)

    async def sweep(self) -> None:
        """Fails turns whose worker stopped renewing its lease, and restarts
        sessions with queued turns but no worker."""
        now = time.time()

        async def scan(s: AsyncSession) -> tuple[list[TurnRow], list[Any], dict[str, tuple[str, str]]]:
            expired = list(
                (
                    await s.execute(
                        select(TurnRow).where(TurnRow.status.in_(("in_progress", "waiting")), TurnRow.lease_expires_at < now)
                    )
                ).scalars()
            )
            stranded = list(
                (
                    await s.execute(
                        select(SessionRow.id, SessionRow.org_id)
                        .where(SessionRow.active_turn_id.is_(None))
                        .where(SessionRow.id.in_(select(TurnRow.session_id).where(TurnRow.status == "queued")))
                    )
                ).all()
            )
            kinds = {
                r.id: (r.environment_kind, r.environment_id)
                for r in (
                    await s.execute(select(SessionRow).where(SessionRow.id.in_([t.session_id for t in expired])))
                ).scalars()
            }
            return expired, stranded, kinds

        expired, stranded, kinds = await self.store.query(scan)
        for turn in expired:
            if self.is_running(turn.id):
                continue
            kind, environment_id = kinds.get(turn.session_id, ("none", ""))
            env_id = environment_id if kind == "hosted" else None
            org_id_var.set(turn.org_id)
            claimed = ClaimedTurn(turn.org_id, turn.session_id, turn.id, env_id, await self._environment(env_id))
            log.warning("turn_lease_expired", session_id=turn.session_id, turn_id=turn.id, worker_id=turn.worker_id)
            await self._finalize(claimed, None, Outcome("failed", "internal_error", "the worker running this turn stopped"))
            self.kick(turn.session_id, turn.org_id)
        for session_id, org_id in stranded:
            self.kick(session_id, org_id)
