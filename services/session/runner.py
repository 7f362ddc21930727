"""Runs turns: one worker task per session with queued work, one turn at a
time per session, inside this service process.

- Claiming a turn is a compare-and-set on ``sessions.active_turn_id`` (the
  per-session mutex), so replicas never run two turns of one session. The
  claim starts the turn in the same transaction (its user items and start
  events) and reads what the harness needs (agent snapshot, transcript).
  Input that reaches an idle session whose environment is known (none, or
  ready: ``EnvironmentCache``) starts its turn in the submitting transaction
  itself (``start_in``); otherwise a worker claims it.
- The worker owning a turn renews a lease on it (``turn_lease_s``, a few
  seconds, renewed every third of it). A cancel from another replica sets
  ``turns.cancel_requested`` and wakes the owner's watcher (``turn_key``,
  announced across replicas by the store's notifier; polled as a safety net). A running turn whose
  lease expired (its process died, or stopped) is taken over by any
  replica's sweeper, with a compare-and-set on its worker: the new worker
  closes the items the old one left open (a command that was running is
  reported to the model as interrupted, with the output it had sent), and
  runs the agent loop again from the persisted transcript, so a model call
  that was interrupted is made again. Events and items already written stay
  as they are and nothing is written twice. A worker that finds its lease
  taken stops without ending the turn. A turn waiting for application
  function results is taken over the same way: the new worker waits for
  the results the old one waited for. The sweeper also restarts sessions
  whose queue was left without a worker.
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
import functools
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import structlog
from sqlalchemy import Table, insert, select, update
from sqlalchemy.engine import CursorResult
from sqlalchemy.ext.asyncio import AsyncSession

from berth.environment.v1 import environment_pb2
from services.core.context import org_id_var
from services.core.errors import BerthError
from services.core.grpc_client import call_until_available
from services.core.ids import new_id
from services.core.lease import Lease
from services.core.logging import get_logger
from services.core.events import wait_set
from services.session import repository as repo
from services.session import views, wire
from services.session.artifacts import BlobStore, OutputFile, collect_outputs, published_state, record_publication
from services.session.automations import Automations
from services.session.environment_cache import EnvironmentCache
from services.session.environment_client import EnvironmentClient
from services.session.function_call_gate import PendingFunctionCall
from services.session.harness.context import ContextLimits
from services.session.harness.io import ItemHandle, TurnFailure
from services.session.harness.loop import run_turn
from services.session.harness.models import ProviderRegistry
from services.session.harness.models.base import Entry, ToolCall
from services.session.harness.subagents import SubagentPort
from services.session.harness.tools import INTERRUPTED, resume_command
from services.session.harness.trace import TraceLink, TurnTrace
from services.session.mcp_connections import McpConnections
from services.session.models import EventRow, FunctionCallRow, ItemRow, SessionRow, TurnRow
from services.session.states import RUNNING_TURN_STATUSES, SessionStatus, TurnStatus
from services.session.history_cache import HistoryCache
from services.session.session_controls import (
    BUDGET_ERROR_CODE,
    PriceTable,
    SessionControls,
    SpendBudget,
    budget_root,
    tree_spend_cents,
)
from services.session.store import Store, Unit, turn_key
from services.session.traces import TraceStore
from services.session.turn_io import DbTurnIO
from services.session.webhooks import announce_artifacts
from services.session.turn_writer import TurnTakenOver, answer_unfinished_call

__all__ = ["TurnRunner", "Outcome", "ClaimedTurn"]

log = get_logger(__name__)

_ITEMS = cast(Table, ItemRow.__table__)
_INSERT_ITEMS = insert(_ITEMS)


class SubagentHost(Protocol):
    """The subagents of sessions (``services/session/subagents.py``), as the
    runner uses them."""

    def port(self, org: str, session_id: str, agent_id: str) -> SubagentPort: ...

    async def interrupt_children(self, org: str, session_id: str) -> None: ...


@dataclass(frozen=True)
class Outcome:
    status: TurnStatus  # COMPLETED, FAILED or CANCELLED
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
    # The output index the turn's next output item takes (non-zero when resumed).
    next_output_index: int = 0
    # The session's review mode and spend budget when the turn started.
    controls_json: str = ""
    # Commands a worker that died left running, to reattach before the loop
    # goes on: (item handle, item, its call, the output already sent).
    reattach: list[tuple[ItemHandle, dict[str, Any], ToolCall, str]] = field(default_factory=list)
    # Application function calls a worker that died left unanswered, to
    # wait for again before the loop goes on.
    rewait: list[PendingFunctionCall] = field(default_factory=list)
    # Whether the turn was already waiting for them (session requires action).
    waiting: bool = False
    # The turn's usage so far (a previous worker's model calls).
    turn_usage: dict[str, Any] | None = None
    # The session's own vaults: its service-origin MCP connections use them.
    vault_ids: list[str] = field(default_factory=list)
    # The subagent the session runs for (None for a root session).
    subagent_id: str | None = None
    # Where a subagent turn's trace continues its root turn's (TraceLink JSON).
    trace_link_json: str = ""


@dataclass
class _Ending:
    """What ending one turn works with. ``io`` is None when the turn is
    ended by a sweeper rather than by its worker."""

    claimed: ClaimedTurn
    io: DbTurnIO | None
    outcome: Outcome
    files: list[OutputFile]
    # Whether ``files`` were recorded as the turn's artifacts.
    recorded: bool = False
    # The turn's trace (ended), published with its outcome.
    trace: TurnTrace | None = None
    trace_published: bool = False
    # As the turn left them (it has settled).
    environment: environment_pb2.Environment | None = field(init=False)
    usage: dict[str, Any] | None = field(init=False)

    def __post_init__(self) -> None:
        self.environment = self.io.environment if self.io is not None else self.claimed.environment
        self.usage = self.io.usage if self.io is not None else None


class TurnRunner:
    def __init__(
        self,
        store: Store,
        env_client: EnvironmentClient | None,
        providers: ProviderRegistry,
        blobs: BlobStore,
        *,
        mcp: McpConnections | None = None,
        lease_s: float = 6.0,
        poll_s: float = 0.5,
        sweep_s: float | None = None,
        dependency_retry_s: float = 0.0,
        automations: Automations | None = None,
        prices: PriceTable | None = None,
        traces: TraceStore | None = None,
        limits: ContextLimits | None = None,
    ) -> None:
        self.automations = automations
        self.store = store
        self.traces = traces
        self.limits = limits or ContextLimits()
        self.env_client = env_client
        self.providers = providers
        self.prices = prices or PriceTable()
        self.blobs = blobs
        self.mcp = mcp
        self.environments = EnvironmentCache(env_client)
        self.histories = HistoryCache()
        self.worker_id = f"w_{secrets.token_hex(8)}"
        self.lease_s = lease_s
        self.poll_s = poll_s
        # Takeover comes within a lease and half of one after a worker died.
        self.sweep_s = sweep_s if sweep_s is not None else min(5.0, lease_s / 2)
        self.dependency_retry_s = dependency_retry_s
        # Turns whose lease another worker took: they stop without an ending.
        self._lost: set[str] = set()
        self._loops: dict[str, asyncio.Task[None]] = {}
        self._dirty: set[str] = set()
        self._turns: dict[str, asyncio.Task[None]] = {}
        # Turns started inside another transaction, waiting for their worker.
        self._started: dict[str, ClaimedTurn] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._closing = False
        # Set by the composition root once the subagents are built (they use
        # the sessions, which use this runner).
        self.subagents: SubagentHost | None = None

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
        self.histories.forget(session_id)

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
            "status": TurnStatus.IN_PROGRESS,
            "started_at": now,
            "worker_id": self.worker_id,
            "lease_expires_at": now + self.lease_s,
        }
        await repo.set_turn_status(u.session, turn.id, (TurnStatus.QUEUED,), **started)
        for key, value in started.items():
            setattr(turn, key, value)
        # Items are only added by the active turn, so this is the whole history.
        transcript = await self.histories.read(u.session, session_id, row.context_from_pk)
        # No turn is waiting for function results: there are no required actions.
        view = await views.session_view(
            u.session, row, environment, prices=self.prices, status=SessionStatus.IN_PROGRESS, actions=[]
        )
        events = [
            wire.turn_event("agent.session.turn.in_progress", views.turn_json(turn)),
            wire.session_event("agent.session.in_progress", view.message),
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
            org_id,
            session_id,
            turn.id,
            environment_id,
            environment,
            row.agent_config_json,
            transcript,
            row.usage_json,
            vault_ids=json.loads(row.vault_ids_json),
            controls_json=row.controls_json,
            subagent_id=row.subagent_id,
            trace_link_json=turn.trace_link_json,
        )

    # ----- running ----------------------------------------------------------------
    async def _budget(self, claimed: ClaimedTurn) -> SpendBudget | None:
        """The spend budget the turn runs under: its session's own, or for a
        subagent's session its tree root's (read only then, so an unbudgeted
        root session's turns cost no query)."""
        if claimed.subagent_id is None and SessionControls.from_json(claimed.controls_json).spend_limit_cents is None:
            return None

        async def root(s: AsyncSession) -> SessionRow:
            return await budget_root(s, await repo.get_session(s, claimed.org_id, claimed.session_id))

        tree = await self.store.query(root)
        limit = SessionControls.from_json(tree.controls_json).spend_limit_cents
        if limit is None:
            return None
        model = str((json.loads(claimed.agent_config_json or "{}").get("config") or {}).get("model") or "")
        return SpendBudget(
            limit,
            self.prices,
            model,
            lambda: self.store.query(lambda s: tree_spend_cents(s, tree, self.prices, except_turn_id=claimed.turn_id)),
        )

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
            next_output_index=claimed.next_output_index,
            mcp=self.mcp,
            vault_ids=claimed.vault_ids,
            on_ending=start_collecting,
            dependency_retry_s=self.dependency_retry_s,
            worker_id=self.worker_id,
            usage=claimed.turn_usage,
            subagents=(
                self.subagents.port(claimed.org_id, claimed.session_id, json.loads(claimed.agent_config_json)["id"])
                if self.subagents is not None and claimed.agent_config_json
                else None
            ),
            automations=self.automations,
            budget=await self._budget(claimed),
            prompt_cache_retention=SessionControls.from_json(claimed.controls_json).prompt_cache_retention,
            prices=self.prices,
        )
        trace = TurnTrace(
            session_id=claimed.session_id, turn_id=claimed.turn_id, link=TraceLink.from_json(claimed.trace_link_json)
        )
        task = asyncio.create_task(self._turn(io, claimed, trace), name=f"turn-{claimed.turn_id}")
        self._turns[claimed.turn_id] = task
        watcher = asyncio.create_task(self._watch(claimed.turn_id, task, io))
        try:
            try:
                await asyncio.wait({task})
            except asyncio.CancelledError:
                # The service is stopping: give the turn up at once, so that
                # another replica (or this service, restarted) resumes it,
                # and leave its running command to be reattached.
                if io.env is not None:
                    io.env.detached = True
                task.cancel()
                await asyncio.wait({task})
                await io.settle()
                await asyncio.shield(self.store.transact(lambda u: self._give_up(u, claimed.turn_id)))
                raise
        finally:
            watcher.cancel()
            self._turns.pop(claimed.turn_id, None)
        await io.settle()
        if claimed.turn_id in self._lost or (not task.cancelled() and isinstance(task.exception(), TurnTakenOver)):
            self._lost.discard(claimed.turn_id)
            log.warning("turn_taken_over", session_id=claimed.session_id, turn_id=claimed.turn_id)
            return False
        if task.cancelled():
            outcome = Outcome(TurnStatus.CANCELLED)
        elif isinstance(task.exception(), TurnFailure):
            failure = task.exception()
            assert isinstance(failure, TurnFailure)
            outcome = Outcome(TurnStatus.FAILED, failure.code, failure.message)
        elif task.exception() is not None:
            log.error("turn_crashed", turn_id=claimed.turn_id, exc_info=task.exception())
            outcome = Outcome(TurnStatus.FAILED, "internal_error", "an internal error ended the turn")
        else:
            outcome = Outcome(TurnStatus.COMPLETED)
        trace.end(str(outcome.status), outcome.code)
        more = await asyncio.shield(self._finalize(claimed, io, outcome, collecting, trace))
        if outcome.status == TurnStatus.CANCELLED and self.subagents is not None:
            # Cancelling a turn interrupts the subagents its model created.
            try:
                await asyncio.shield(self.subagents.interrupt_children(claimed.org_id, claimed.session_id))
            except BerthError:
                log.warning("subagent_interrupt_failed", session_id=claimed.session_id, exc_info=True)
        return more

    async def _turn(self, io: DbTurnIO, claimed: ClaimedTurn, trace: TurnTrace) -> None:
        """The agent loop, after finishing the commands a resumed turn's
        previous worker left running."""
        for handle, item, call, shown in claimed.reattach:
            await resume_command(io, handle, item, call, shown)
        if claimed.rewait:
            await io.calls.resume_waiting(claimed.rewait, already_waiting=claimed.waiting)
        await run_turn(
            io,
            self.providers.for_model,
            tool_concurrency=self.providers.tool_concurrency,
            limits=self.limits,
            trace=trace,
            estimator=self.histories.estimator(claimed.session_id),
        )

    async def _watch(self, turn_id: str, task: asyncio.Task[None], io: DbTurnIO) -> None:
        """Renews the turn's lease, and waits for cancels sent to other
        replicas (and for the turn having been ended elsewhere, e.g. by a
        sweeper): either cancels the turn."""
        lease = Lease(
            lambda: self.store.transact(lambda u: self._renew(u, turn_id)),
            every_s=self.lease_s / 3,
            on_lost=lambda: self._lose(turn_id, task, io),
            failure_event="turn_watch_failed",
            log_fields={"turn_id": turn_id},
        )
        async with lease:
            await self._wait_stop(turn_id, task)
        if not task.done():
            task.cancel()

    def _lose(self, turn_id: str, task: asyncio.Task[None], io: DbTurnIO) -> None:
        """Another worker took the turn over: stop, and leave its running
        command to that worker."""
        self._lost.add(turn_id)
        if io.env is not None:
            io.env.detached = True
        task.cancel()

    async def _give_up(self, u: Unit, turn_id: str) -> None:
        """Expires this worker's lease on a turn it stops running."""
        await u.session.execute(
            update(TurnRow).where(TurnRow.id == turn_id, TurnRow.worker_id == self.worker_id).values(lease_expires_at=0.0)
        )

    async def _wait_stop(self, turn_id: str, task: asyncio.Task[None]) -> None:
        """Returns once the turn should stop: checked when a cancel is
        announced (``turn_key``, also from other replicas), and every
        ``poll_s`` when other replicas are not heard (a slow safety net
        when they are)."""
        notifier = self.store.notifier
        wake = notifier.subscribe(turn_key(turn_id))
        try:
            while True:
                await wait_set(wake, notifier.poll_s(self.poll_s))
                wake.clear()
                try:
                    if await self._should_stop(turn_id, task):
                        return
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.warning("turn_watch_failed", exc_info=True, turn_id=turn_id)
        finally:
            notifier.unsubscribe(turn_key(turn_id), wake)

    async def _should_stop(self, turn_id: str, task: asyncio.Task[None]) -> bool:
        return task.done() or await self.store.query(lambda s: self._turn_ended(s, turn_id))

    async def _turn_ended(self, s: AsyncSession, turn_id: str) -> bool:
        row = (await s.execute(select(TurnRow.cancel_requested, TurnRow.status).where(TurnRow.id == turn_id))).one_or_none()
        return row is None or bool(row[0]) or row[1] not in RUNNING_TURN_STATUSES

    async def _renew(self, u: Unit, turn_id: str) -> bool:
        """Extends the lease while this worker owns the turn; False once the
        turn's row is gone."""
        result = await u.session.execute(
            update(TurnRow)
            .where(TurnRow.id == turn_id, TurnRow.worker_id == self.worker_id)
            .values(lease_expires_at=time.time() + self.lease_s)
        )
        return int(cast(CursorResult[Any], result).rowcount) == 1

    async def _collect(self, claimed: ClaimedTurn, io: DbTurnIO | None) -> list[OutputFile]:
        if not claimed.environment_id or self.env_client is None:
            return []
        client, environment_id = self.env_client, claimed.environment_id

        async def collect() -> list[OutputFile]:
            if io is None or not io.environment_ready:
                env = await client.get_environment(environment_id)
                if env.status != environment_pb2.ENVIRONMENT_STATUS_READY:
                    return []
            outputs = await client.list_session_outputs(environment_id, claimed.session_id)
            if outputs.environment is not None:
                self.environments.refreshed(claimed.session_id, environment_id, outputs.environment)
            return await collect_outputs(
                client,
                self.blobs,
                lambda: self.store.query(lambda s: published_state(s, claimed.session_id)),
                outputs,
                environment_id=environment_id,
            )

        # Reading outputs repeats safely; an Environment service that is
        # restarting is waited for like any call of the turn.
        return await call_until_available(collect, within_s=self.dependency_retry_s)

    async def _finalize(
        self,
        claimed: ClaimedTurn,
        io: DbTurnIO | None,
        outcome: Outcome,
        collecting: list[asyncio.Task[list[OutputFile]]] | None = None,
        trace: TurnTrace | None = None,
    ) -> bool:
        """Ends the turn in one transaction; returns whether the session may
        have another queued turn. ``collecting`` holds the task that reads
        the turn's outputs when it was started early."""
        outcome, files = await self._read_outputs(claimed, io, outcome, collecting)
        ending = _Ending(claimed, io, outcome, files, trace=trace)
        try:
            more = await self.store.transact(lambda u: self._end_turn(u, ending))
        finally:
            await self._drop_unpublished(ending)
        if ending.trace_published and self.traces is not None and trace is not None:
            self.traces.export(claimed.turn_id, trace)
        self._remember_environment(claimed, io, outcome)
        log.info("turn_finished", session_id=claimed.session_id, turn_id=claimed.turn_id, status=outcome.status, code=outcome.code)
        return more

    async def _read_outputs(
        self,
        claimed: ClaimedTurn,
        io: DbTurnIO | None,
        outcome: Outcome,
        collecting: list[asyncio.Task[list[OutputFile]]] | None,
    ) -> tuple[Outcome, list[OutputFile]]:
        """The output files a completed turn publishes, read now unless their
        reading already started. A turn whose outputs cannot be read fails.
        A turn that ended otherwise after its outputs were read publishes
        nothing, and the blobs read are removed once it ended."""
        if outcome.status == TurnStatus.COMPLETED:
            try:
                return outcome, await (collecting[0] if collecting else self._collect(claimed, io))
            except BerthError as exc:
                failure = io.sandbox_failure(exc) if io is not None else TurnFailure("sandbox_error", exc.message)
                return Outcome(TurnStatus.FAILED, "sandbox_error", f"publishing outputs failed: {failure.message}"), []
        if collecting:
            try:
                return outcome, await collecting[0]
            except Exception:
                log.warning("turn_outputs_dropped", session_id=claimed.session_id, turn_id=claimed.turn_id, exc_info=True)
        return outcome, []

    async def _end_turn(self, u: Unit, ending: _Ending) -> bool:
        """The ending transaction: the turn's terminal status, its open items
        and function calls, its published outputs, the session's release and
        the events telling followers. Returns whether the session may have
        another queued turn."""
        now = time.time()
        if ending.io is not None and not await self._still_ours(u, ending.claimed.turn_id):
            # Taken over meanwhile: the new worker ends it.
            return False
        turn = await self._write_outcome(u, ending, now)
        if turn is None:
            # Ended elsewhere (a sweeper); whoever did that restarts the queue too.
            return True
        await self._close_turn_work(u, ending)
        await self._publish_outputs(u, ending)
        if ending.trace is not None and self.traces is not None:
            await self.traces.record(u, turn, ending.trace)
            ending.trace_published = True
        released = await self._release_session(u, ending, now)
        if released is None:
            row, more = await repo.get_session(u.session, ending.claimed.org_id, ending.claimed.session_id), True
            status = SessionStatus.FAILED if row.error else SessionStatus.IDLE
        else:
            row, more = released
            status = SessionStatus(row.status)
        events = await self._ending_events(u, ending, turn, row, status)
        if released is not None:
            u.append(ending.claimed.session_id, row.event_seq, *events)
        else:
            await u.emit(ending.claimed.session_id, *events)
        u.wake_key(f"calls:{ending.claimed.turn_id}")
        if ending.io is None:
            # Ended by a sweeper: the turn's worker, wherever it still runs, stands down.
            u.wake_key(turn_key(ending.claimed.turn_id))
        return more

    async def _still_ours(self, u: Unit, turn_id: str) -> bool:
        worker = await u.session.scalar(select(TurnRow.worker_id).where(TurnRow.id == turn_id))
        return worker is None or worker == self.worker_id

    async def _write_outcome(self, u: Unit, ending: _Ending, now: float) -> TurnRow | None:
        """Moves the turn from ``in_progress``/``waiting`` to its outcome;
        None when it had already ended."""
        io, outcome = ending.io, ending.outcome
        values: dict[str, Any] = {}
        if io is not None:
            values["next_output_index"] = io.next_output_index
        return await repo.transition_turn(
            u.session,
            ending.claimed.turn_id,
            RUNNING_TURN_STATUSES,
            status=outcome.status,
            completed_at=now,
            error_code=outcome.code,
            error_message=outcome.message,
            usage_json=json.dumps(ending.usage) if ending.usage is not None else "",
            **values,
        )

    async def _close_turn_work(self, u: Unit, ending: _Ending) -> None:
        """Closes the items a turn that did not complete left open, and
        cancels the function calls still waiting for results."""
        io = ending.io
        if io is not None and ending.outcome.status != TurnStatus.COMPLETED:
            await io.close_open_items(u)
        if io is None or io.made_function_calls:
            await u.session.execute(
                update(FunctionCallRow)
                .where(FunctionCallRow.turn_id == ending.claimed.turn_id, FunctionCallRow.state.in_(("pending", "answered")))
                .values(state="cancelled")
            )

    async def _publish_outputs(self, u: Unit, ending: _Ending) -> None:
        """Records the output files of a completed turn as its artifacts."""
        if ending.outcome.status != TurnStatus.COMPLETED or not ending.files:
            return
        claimed = ending.claimed
        artifacts = await record_publication(
            u.session,
            ending.files,
            org_id=claimed.org_id,
            session_id=claimed.session_id,
            turn_id=claimed.turn_id,
            environment_id=str(claimed.environment_id),
        )
        await announce_artifacts(u, claimed.org_id, artifacts)
        ending.recorded = True

    async def _release_session(self, u: Unit, ending: _Ending, now: float) -> tuple[SessionRow, bool] | None:
        """Releases the session's mutex, adding the turn's usage to the
        session's and allocating the ending events' sequence numbers."""
        claimed, usage = ending.claimed, ending.usage
        session_usage = None
        if usage is not None:
            # Only the turn holding the mutex changes the session's usage,
            # so what the claim read is still current.
            session_usage = wire.add_usage(wire.parse_usage(claimed.usage_json), usage)
        return await repo.release_active_turn(
            u.session,
            claimed.session_id,
            claimed.turn_id,
            now,
            events=3 if ending.outcome.status == TurnStatus.FAILED else 2,
            usage_json=json.dumps(session_usage) if session_usage is not None else None,
            # A root session pauses at its budget; a subagent's session (its
            # root's budget) goes idle, and its parent's turn stops there too.
            budget_reached=ending.outcome.code == BUDGET_ERROR_CODE and claimed.subagent_id is None,
        )

    async def _ending_events(
        self, u: Unit, ending: _Ending, turn: TurnRow, row: SessionRow, status: str
    ) -> list[dict[str, Any]]:
        """The error (of a failed turn), turn and session events that end the turn."""
        outcome = ending.outcome
        # The turn's function calls were cancelled, so none is required.
        view = await views.session_view(
            u.session, row, ending.environment, prices=self.prices, status=status, actions=[]
        )
        events = []
        if outcome.status == TurnStatus.FAILED:
            events.append(wire.error_event(ending.claimed.session_id, outcome.code, outcome.code, outcome.message))
        events.append(wire.turn_event(f"agent.session.turn.{outcome.status}", views.turn_json(turn), with_usage=True))
        events.append(wire.session_event(f"agent.session.{status}", view.message))
        return events

    async def _drop_unpublished(self, ending: _Ending) -> None:
        """Removes the blobs of output files read but not recorded (the turn
        did not complete, or its ending transaction failed)."""
        if ending.files and not ending.recorded:
            shas = sorted({f.sha256 for f in ending.files})
            self.blobs.delete(await self.store.query(lambda s: repo.unreferenced_blobs(s, shas)))

    def _remember_environment(self, claimed: ClaimedTurn, io: DbTurnIO | None, outcome: Outcome) -> None:
        """Keeps what the turn learnt about its environment for the next turn."""
        if outcome.code == "sandbox_error":
            self.environments.forget(claimed.session_id)
        elif io is not None and io.environment is not claimed.environment:
            # The turn read the environment itself (e.g. it waited for setup).
            self.environments.remember(claimed.session_id, claimed.environment_id, io.environment)

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
                        select(TurnRow).where(TurnRow.status.in_(RUNNING_TURN_STATUSES), TurnRow.lease_expires_at < now)
                    )
                ).scalars()
            )
            stranded = list(
                (
                    await s.execute(
                        select(SessionRow.id, SessionRow.org_id)
                        .where(SessionRow.active_turn_id.is_(None), SessionRow.status != SessionStatus.BUDGET_REACHED)
                        .where(SessionRow.id.in_(select(TurnRow.session_id).where(TurnRow.status == TurnStatus.QUEUED)))
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
            if self.is_running(turn.id) or self._closing:
                continue
            kind, environment_id = kinds.get(turn.session_id, ("none", ""))
            env_id = environment_id if kind == "hosted" else None
            org_id_var.set(turn.org_id)
            if turn.status in (TurnStatus.IN_PROGRESS, TurnStatus.WAITING):
                resumed = await self.store.transact(functools.partial(self._take_over, turn=turn, environment_id=env_id))
                if resumed is not None:
                    resumed.environment = await self._environment(env_id)
                    log.warning(
                        "turn_resumed", session_id=turn.session_id, turn_id=turn.id, previous_worker_id=turn.worker_id
                    )
                    self.run_started(resumed)
                continue
            claimed = ClaimedTurn(turn.org_id, turn.session_id, turn.id, env_id, await self._environment(env_id))
            log.warning("turn_lease_expired", session_id=turn.session_id, turn_id=turn.id, worker_id=turn.worker_id)
            await self._finalize(claimed, None, Outcome(TurnStatus.FAILED, "internal_error", "the worker running this turn stopped"))
            self.kick(turn.session_id, turn.org_id)
        for session_id, org_id in stranded:
            self.kick(session_id, org_id)

    async def _take_over(self, u: Unit, turn: TurnRow, environment_id: str | None) -> ClaimedTurn | None:
        """Takes an in-progress or waiting turn whose lease expired over from
        its worker (a compare-and-set on the worker and the expiry), closes
        the items that worker left open, and reads what the harness needs to
        run the turn on; None when another replica was first. Application
        function calls still unanswered stay open: the new worker waits for
        their results as the old one did."""
        now = time.time()
        taken = await u.session.execute(
            update(TurnRow)
            .where(
                TurnRow.id == turn.id,
                TurnRow.status == turn.status,
                TurnRow.worker_id == turn.worker_id,
                TurnRow.lease_expires_at == turn.lease_expires_at,
            )
            .values(worker_id=self.worker_id, lease_expires_at=now + self.lease_s)
        )
        if int(cast(CursorResult[Any], taken).rowcount) != 1:
            return None
        session = (await u.session.execute(select(SessionRow).where(SessionRow.id == turn.session_id))).scalar_one()
        events = (
            await u.session.execute(
                select(EventRow.event_json)
                .where(
                    EventRow.session_id == turn.session_id,
                    EventRow.turn_id == turn.id,
                    EventRow.type.in_(("agent.session.turn.item.added", "agent.output.command_execution_output.delta")),
                )
                .order_by(EventRow.seq)
            )
        ).scalars()
        next_output_index = 0
        output_index: dict[str, int] = {}
        captured: dict[str, list[str]] = {}
        for event_json in events:
            event = json.loads(event_json)
            if event["type"] == "agent.session.turn.item.added":
                index = event.get("output_index")
                if isinstance(index, int):
                    output_index[event["item"]["id"]] = index
                    next_output_index = max(next_output_index, index + 1)
            else:
                captured.setdefault(str(event.get("item_id")), []).append(str(event.get("delta") or ""))
        history = await u.session.execute(
            select(ItemRow.id, ItemRow.turn_id, ItemRow.item_json, ItemRow.model_json)
            .where(ItemRow.session_id == turn.session_id)
            .order_by(ItemRow.pk)
        )
        transcript: list[tuple[str, list[Entry]]] = []
        closed: list[dict[str, Any]] = []
        reattach: list[tuple[ItemHandle, dict[str, Any], ToolCall, str]] = []
        rewait: list[PendingFunctionCall] = []
        for item_id, turn_id, item_json, model_json in history:
            entries: list[Entry] = json.loads(model_json)
            if turn_id == turn.id:
                item = json.loads(item_json)
                calls = entries[0].get("tool_calls") if len(entries) == 1 else None
                if item.get("status") == "in_progress" and calls and calls[0].get("name") == "exec_command":
                    # Still open: the resumed turn reattaches to the command first.
                    call = ToolCall(str(calls[0]["id"]), "exec_command", str(calls[0].get("arguments") or ""))
                    shown = "".join(captured.get(item_id, []))
                    reattach.append((ItemHandle(item_id, output_index.get(item_id)), item, call, shown))
                    transcript.append((item_id, entries))
                    continue
                if item.get("status") == "in_progress" and item.get("type") == "function_call" and calls:
                    # The application answers it (or has): wait for it again.
                    rewait.append(
                        PendingFunctionCall(
                            str(item["call_id"]), str(calls[0]["id"]), ItemHandle(item_id, output_index.get(item_id)), item
                        )
                    )
                    transcript.append((item_id, entries))
                    continue
                if item.get("status") == "in_progress":
                    entries = _interrupted(item, entries, "".join(captured.get(item_id, [])))
                    await u.session.execute(
                        update(ItemRow)
                        .where(ItemRow.id == item_id)
                        .values(item_json=json.dumps(item), model_json=json.dumps(entries))
                    )
                    if item_id in output_index:
                        closed.append(
                            {
                                "type": "agent.session.turn.item.done",
                                "session_id": turn.session_id,
                                "turn_id": turn.id,
                                "item": item,
                                "output_index": output_index[item_id],
                            }
                        )
            transcript.append((item_id, entries))
        if closed:
            counter = await u.session.execute(
                update(SessionRow)
                .where(SessionRow.id == turn.session_id)
                .values(event_seq=SessionRow.event_seq + len(closed))
                .returning(SessionRow.event_seq)
            )
            u.append(turn.session_id, int(counter.scalar_one()), *closed)
        return ClaimedTurn(
            turn.org_id,
            turn.session_id,
            turn.id,
            environment_id,
            None,
            session.agent_config_json,
            transcript,
            session.usage_json,
            next_output_index=next_output_index,
            reattach=reattach,
            rewait=rewait,
            waiting=turn.status == TurnStatus.WAITING,
            turn_usage=wire.parse_usage(turn.usage_json),
            vault_ids=json.loads(session.vault_ids_json),
            controls_json=session.controls_json,
            subagent_id=session.subagent_id,
            trace_link_json=turn.trace_link_json,
        )


def _interrupted(item: dict[str, Any], entries: list[Entry], captured: str) -> list[Entry]:
    """Closes an item a dead worker left open, in place; returns its model
    entries. A tool call is answered as interrupted, with the output it had
    sent."""
    item["status"] = "incomplete"
    if item.get("type") == "command_execution":
        item["output"] = captured or None
    output = INTERRUPTED + (f"; its output so far:\n{captured}" if captured else "")
    return answer_unfinished_call(entries, output) or entries
