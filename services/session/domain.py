"""The Session service's logic, one class per job: saved agents, sessions,
input, history (turns, items, artifacts), traces, the event stream and subagents. Plain async
methods, testable without gRPC; every method scopes by the caller's
organization (``current_org()``), and another organization's resource is
``NotFound``.
"""

from __future__ import annotations

from services.session.artifacts import BlobStore
from services.session.environment_client import EnvironmentClient
from services.session.event_stream import EventStream
from services.session.history import SessionHistory
from services.session.mcp_connections import McpConnections
from services.session.runner import TurnRunner
from services.session.saved_agents import SavedAgents
from services.session.session_input import SessionInput
from services.session.sessions import Sessions
from services.session.store import Store
from services.session.subagents import Subagents
from services.session.traces import TraceStore

__all__ = ["SessionDomain"]


class SessionDomain:
    """The parts of the Session service, built once over one store."""

    def __init__(
        self,
        store: Store,
        env_client: EnvironmentClient | None,
        runner: TurnRunner,
        blobs: BlobStore,
        *,
        mcp: McpConnections | None = None,
        traces: TraceStore | None = None,
        poll_s: float = 0.2,
    ) -> None:
        self.agents = SavedAgents(store)
        self.sessions = Sessions(store, env_client, runner, blobs, mcp)
        self.input = SessionInput(store, runner, runner.prices)
        self.history = SessionHistory(store, blobs)
        self.events = EventStream(store, poll_s=poll_s)
        self.subagents = Subagents(store, self.sessions, self.input)
        runner.subagents = self.subagents
        self.traces = traces or TraceStore(store)
