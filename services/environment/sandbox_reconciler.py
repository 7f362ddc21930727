"""Destroys sandboxes whose environment no longer exists, or lives elsewhere.

The Sandbox service cannot tell an orphan: environment identity lives here.
A pass lists, on every configured Sandbox service node, every
organization's sandboxes that carry the ``berth.environment_id`` label and
destroys each one whose environment has no row in the sandbox's
organization. Such sandboxes come from a create that completed after its
environment was deleted (its setup owner died during CreateSandbox), a
database restored from an older backup, or rows removed by hand. A pass
runs on start and then every ``interval_s``. A node that cannot be listed
is skipped for that pass (and logged); the others are still reconciled.

A sandbox of an existing environment found on another node than the one
its row records is an orphan copy: nothing routes to it. It comes from a
setup that was deferred after CreateSandbox reached one node but its answer
did not (the node became unreachable), and whose retry was placed on
another node because that one was still unreachable (a retry keeps the
recorded node while it answers). It is destroyed (``node_mismatch``) only when all of these
hold, so that a copy that might still be the environment's only sandbox is
kept:

* the environment's setup has settled (ready or failed), so no retry will
  place its sandbox again (a retry may reuse a copy: CreateSandbox is
  idempotent, while a destroyed identity is never created again);
* the node the row names was listed in the same pass and holds the
  environment's own sandbox. So an empty name (rows from before nodes, the
  one unnamed node) is never second-guessed, and a row naming a node that
  was removed or renamed keeps every copy until an operator sorts it out.

What keeps a pass from destroying a sandbox someone still needs:

* A sandbox younger than ``grace_s`` (by its ``create_time``) is left alone,
  whatever the database says, so a create racing with the commit of its
  environment, or clocks that disagree, never lose a sandbox.
* The environment's row is read again right before each destroy.
* A row that is being deleted still counts as existing: its teardown
  destroys the sandbox itself, and a teardown whose destroy fails puts the
  environment back, which must find its sandbox.
* A pass that would destroy more than ``max_fraction`` of the labelled
  sandboxes past their grace (and more than ``MASS_REAP_FLOOR`` of them)
  destroys none and logs ``sandbox_reconcile_refused``: that many orphans at
  once means the service most likely reads the wrong (or a restored, or an
  empty) database, and the sandboxes are users' work. An operator who means
  it sets ``BERTH_ENVIRONMENT_RECONCILE_MAX_FRACTION=1`` for a pass.

Replicas may run passes at the same time: DestroySandbox is idempotent and
a sandbox that is gone already is not an error, so the worst case is two
calls for one orphan (each replica counts the reaps it made).

The reverse case, a ready environment whose sandbox is gone, is not touched:
an environment's status is its setup state, a ready environment never runs setup again, and an
unusable sandbox never changes the environment (operations report it).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.core.db import Database
from services.core.errors import BerthError
from services.core.logging import get_logger
from services.core.metrics import ORPHAN_SANDBOXES_REAPED
from services.environment import repository as repo
from services.environment.compute import EnvironmentSandbox, SandboxInventory, SandboxRef
from services.environment.states import SETTLED_STATUSES

__all__ = [
    "SandboxReconciler",
    "ReapedSandbox",
    "REASON_ENVIRONMENT_NOT_FOUND",
    "REASON_ORGANIZATION_MISMATCH",
    "REASON_NODE_MISMATCH",
    "MASS_REAP_FLOOR",
]

log = get_logger(__name__)

# No environment with the label's ID exists.
REASON_ENVIRONMENT_NOT_FOUND = "environment_not_found"
# The environment exists, but in another organization than the sandbox's.
REASON_ORGANIZATION_MISMATCH = "organization_mismatch"
# The environment exists and its sandbox is on the node its row records;
# this one is a copy on another node.
REASON_NODE_MISMATCH = "node_mismatch"

# Up to this many orphans a pass always reaps, whatever their fraction.
MASS_REAP_FLOOR = 10

# Environment IDs per query, well under every driver's parameter limit.
_CHUNK = 500


@dataclass(frozen=True)
class ReapedSandbox:
    """One sandbox a pass destroyed, and why."""

    sandbox_id: str
    environment_id: str
    org_id: str
    reason: str
    node: str = ""


class SandboxReconciler:
    def __init__(
        self,
        db: Database,
        inventory: SandboxInventory,
        *,
        interval_s: float,
        grace_s: float,
        max_fraction: float = 0.5,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._db = db
        self._inventory = inventory
        self._interval_s = interval_s
        self._grace_s = grace_s
        self._max_fraction = max_fraction
        self._clock = clock
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Runs a pass now and then every ``interval_s`` in the background."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="environment-sandbox-reconciler")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def reconcile(self) -> list[ReapedSandbox]:
        """One pass; returns the sandboxes it destroyed. A sandbox that could
        not be destroyed is logged and left for the next pass. Fails only
        when no node could be listed."""
        nodes = list(self._inventory.node_names())
        listings = await asyncio.gather(
            *(self._inventory.list_environment_sandboxes(node) for node in nodes), return_exceptions=True
        )
        listed: list[EnvironmentSandbox] = []
        answered = 0
        failure: BerthError | None = None
        for node, listing in zip(nodes, listings, strict=True):
            if isinstance(listing, BerthError):
                log.warning("sandbox_node_list_failed", node=node, code=listing.grpc_code.name, error=listing.message)
                failure = listing
            elif isinstance(listing, BaseException):
                raise listing
            else:
                answered += 1
                listed.extend(listing)
        if answered == 0 and failure is not None:
            raise failure
        view = _PassView(held=frozenset((s.node, s.sandbox_id) for s in listed))
        now = self._clock()
        old = [s for s in listed if now - s.created_at >= self._grace_s]
        recorded = await self._recorded([s.environment_id for s in old])
        orphans = [s for s in old if view.reason(s, recorded) is not None]
        if len(orphans) > MASS_REAP_FLOOR and len(orphans) > self._max_fraction * len(old):
            log.error(
                "sandbox_reconcile_refused",
                orphans=len(orphans),
                labelled=len(old),
                max_fraction=self._max_fraction,
                detail="too many sandboxes look orphaned at once; check the environment database",
            )
            return []
        reaped: list[ReapedSandbox] = []
        for sandbox in orphans:
            done = await self._reap(sandbox, view)
            if done is not None:
                reaped.append(done)
        return reaped

    async def _recorded(self, environment_ids: Sequence[str]) -> dict[str, repo.RecordedSandbox]:
        unique = sorted(set(environment_ids))
        recorded: dict[str, repo.RecordedSandbox] = {}
        async with self._db.transaction(read_only=True) as s:
            for i in range(0, len(unique), _CHUNK):
                recorded.update(await repo.recorded_sandboxes(s, unique[i : i + _CHUNK]))
        return recorded

    async def _reap(self, sandbox: EnvironmentSandbox, view: _PassView) -> ReapedSandbox | None:
        # The decision is made on the row as it is now, not as the pass's
        # first read saw it.
        reason = view.reason(sandbox, await self._recorded([sandbox.environment_id]))
        if reason is None:
            return None
        ids = {
            "sandbox_id": sandbox.sandbox_id,
            "environment_id": sandbox.environment_id,
            "org_id": sandbox.org_id,
            "node": sandbox.node,
        }
        try:
            await self._inventory.destroy_org_sandbox(sandbox.org_id, SandboxRef(sandbox.sandbox_id, sandbox.node))
        except BerthError as exc:
            log.warning("orphan_sandbox_reap_failed", **ids, reason=reason, error=exc.message)
            return None
        ORPHAN_SANDBOXES_REAPED.labels(reason=reason).inc()
        log.info("orphan_sandbox_reaped", **ids, reason=reason)
        return ReapedSandbox(reason=reason, **ids)

    async def _run(self) -> None:
        while True:
            try:
                reaped = await self.reconcile()
                if reaped:
                    log.info("sandbox_reconcile_finished", reaped=len(reaped))
            except BerthError as exc:
                log.warning("sandbox_reconcile_failed", code=exc.grpc_code.name, error=exc.message)
            except Exception:
                log.exception("sandbox_reconcile_crashed")
            await asyncio.sleep(self._interval_s)


@dataclass(frozen=True)
class _PassView:
    """What one pass saw of the nodes."""

    # (node, sandbox_id) of every sandbox listed, young ones included.
    held: frozenset[tuple[str, str]]

    def reason(self, sandbox: EnvironmentSandbox, recorded: dict[str, repo.RecordedSandbox]) -> str | None:
        """Why the sandbox is an orphan, or None when it is its environment's."""
        record = recorded.get(sandbox.environment_id)
        if record is None:
            return REASON_ENVIRONMENT_NOT_FOUND
        if record.org_id != sandbox.org_id:
            return REASON_ORGANIZATION_MISMATCH
        node = record.sandbox_node
        if node != sandbox.node and record.status in SETTLED_STATUSES and (node, record.sandbox_id) in self.held:
            return REASON_NODE_MISMATCH
        return None
