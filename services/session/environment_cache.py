"""What this replica knows about the environments of its sessions, so a turn
can start without asking the Environment service.

Only facts that cannot change are kept: a session has no environment (a
session's environment binding is fixed when it is created), or its
environment is ready (setup never undoes that; only deletion ends it). The
snapshot kept for rendering also carries fields that do change
(``session_count``, ``lifetime``), so a snapshot older than ``refresh_s`` is
refreshed in the background when it is next used, never on a turn's path.
A turn's output listing returns a snapshot too (``refreshed``), so a session
that runs turns keeps a fresh one without asking for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

from berth.environment.v1 import environment_pb2
from services.core.errors import BerthError, NotFound
from services.core.logging import get_logger
from services.session.environment_client import EnvironmentClient

__all__ = ["EnvironmentCache", "KnownEnvironment"]

log = get_logger(__name__)


@dataclass(frozen=True)
class KnownEnvironment:
    # None: the session has no environment.
    environment_id: str | None
    # The ready environment's last snapshot (None without an environment).
    environment: environment_pb2.Environment | None
    fetched_at: float


class EnvironmentCache:
    def __init__(self, env_client: EnvironmentClient | None, *, limit: int = 4096, refresh_s: float = 5.0) -> None:
        self._env = env_client
        self._limit = limit
        self._refresh_s = refresh_s
        self._known: dict[str, KnownEnvironment] = {}
        self._refreshing: dict[str, asyncio.Task[None]] = {}

    def get(self, session_id: str) -> KnownEnvironment | None:
        known = self._known.pop(session_id, None)
        if known is None:
            return None
        self._known[session_id] = known  # most recently used last
        if (
            known.environment_id is not None
            and time.monotonic() - known.fetched_at > self._refresh_s
            and session_id not in self._refreshing
        ):
            task = asyncio.create_task(self._refresh(session_id, known.environment_id), name=f"environment-refresh-{session_id}")
            self._refreshing[session_id] = task
            task.add_done_callback(lambda _: self._refreshing.pop(session_id, None))
        return known

    def remember(self, session_id: str, environment_id: str | None, environment: environment_pb2.Environment | None) -> None:
        """Keeps the session's environment if it can no longer change state:
        none at all, or ready."""
        if environment_id is not None and (environment is None or environment.status != environment_pb2.ENVIRONMENT_STATUS_READY):
            return
        self._known.pop(session_id, None)
        self._known[session_id] = KnownEnvironment(environment_id, environment, time.monotonic())
        while len(self._known) > self._limit:
            del self._known[next(iter(self._known))]

    def forget(self, session_id: str) -> None:
        self._known.pop(session_id, None)

    async def close(self) -> None:
        tasks = list(self._refreshing.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _refresh(self, session_id: str, environment_id: str) -> None:
        assert self._env is not None
        try:
            environment = await self._env.get_environment(environment_id)
        except NotFound:
            self.forget(session_id)
            return
        except BerthError as exc:
            log.warning("environment_refresh_failed", environment_id=environment_id, reason=exc.reason)
            return
        self.refreshed(session_id, environment_id, environment)

    def refreshed(self, session_id: str, environment_id: str, environment: environment_pb2.Environment) -> None:
        """A snapshot of the session's environment read just now, by a
        refresh or on the way (a turn's output listing carries one): it
        replaces what is kept of a session that is known, and restarts its
        age, so an active session needs no refresh of its own."""
        known = self._known.get(session_id)
        if known is None or known.environment_id != environment_id:
            return
        if environment.status == environment_pb2.ENVIRONMENT_STATUS_READY:
            self.remember(session_id, environment_id, environment)
        else:
            self.forget(session_id)
