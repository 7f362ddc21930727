"""What the harness needs from the service around it: persistence of items
and events, function-call waits, the environment (through its port,
``harness/environment.py``) and MCP servers. ``services.session``
implements it over the database and the Environment service; harness tests
can implement it in memory."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import mcp_types

from services.session.agents import AgentConfig
from services.session.harness.environment import EnvironmentPort
from services.session.harness.models.base import Entry, Usage

if TYPE_CHECKING:
    from services.session.harness.subagents import SubagentPort
    from services.session.harness.automation_tool import AgentSchedule

__all__ = ["TurnIO", "ItemHandle", "FunctionResult", "TurnFailure", "McpUnavailable", "McpClient"]


class TurnFailure(Exception):
    """Ends the turn as failed with a `SessionTurnError` code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class McpUnavailable(Exception):
    """An MCP server cannot be used: it failed to start or initialize, it
    died, or this session cannot reach it."""

    def __init__(self, message: str, *, reason: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason


class McpClient(Protocol):
    """An initialized connection to one MCP server."""

    @property
    def tools(self) -> list[mcp_types.Tool]:
        """The server's tools as last listed."""
        ...

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> mcp_types.CallToolResult: ...


@dataclass(frozen=True)
class ItemHandle:
    id: str
    output_index: int | None


@dataclass(frozen=True)
class FunctionResult:
    call_id: str
    success: bool
    output: Any
    error: str | None


class TurnIO(Protocol):
    session_id: str
    turn_id: str
    environment_id: str | None
    # The session's prompt cache retention for model calls; None: the model's default.
    prompt_cache_retention: str | None

    @property
    def env(self) -> EnvironmentPort | None:
        """The session's environment; None when it has none."""
        ...

    @property
    def subagents(self) -> SubagentPort | None:
        """The session's subagents; None when the service offers none."""
        ...

    async def agent_config(self) -> AgentConfig:
        """The session's current agent snapshot (updates apply on the next model call)."""
        ...

    async def transcript(self) -> list[Entry]:
        """Model-facing entries of the session history, in order (after its
        compactions, ``harness/context.py``)."""
        ...

    async def transcript_items(self) -> list[tuple[str, list[Entry]]]:
        """The same, per item: (item ID, its entries)."""
        ...

    async def add_item(
        self,
        item: dict[str, Any],
        *,
        entries: list[Entry],
        output: bool,
        done: bool,
        visible: bool = True,
        hold: bool = False,
    ) -> ItemHandle:
        """Persists an item and emits turn.item.added (and item.done when ``done``).
        ``output`` items are agent output and get an output_index. With
        ``hold`` the write is only staged, for the next write or
        ``flush_behind`` to persist."""
        ...

    def track_item(self, handle: ItemHandle, item: dict[str, Any]) -> None:
        """Remembers the latest in-memory state of an open item, so a cancel can close it."""
        ...

    async def finish_item(self, handle: ItemHandle, item: dict[str, Any], *, entries: list[Entry], hold: bool = False) -> None:
        """Stores the final item and emits turn.item.done (``hold``: as for ``add_item``)."""
        ...

    def flush_behind(self) -> None:
        """Starts persisting the staged writes without waiting for them; every
        later write (and the turn's ending) begins after they are persisted."""
        ...

    async def written(self) -> None:
        """Waits until what ``flush_behind`` started is persisted; raises its
        failure (a takeover, say). A turn ends only after this returns, so
        it never ends as completed with a write of it lost."""
        ...

    async def emit(self, *events: dict[str, Any]) -> None:
        """Appends scoped events (session_id and turn_id are filled in)."""
        ...

    def batch(self) -> AbstractAsyncContextManager[None]:
        """Within the block, ``add_item``, ``finish_item`` and ``emit`` only
        stage their writes; they are persisted together, in order, when the
        block ends, so nothing inside it may wait for anything else."""
        ...

    async def add_function_call(self, name: str, arguments: str, model_call_id: str) -> str:
        """Registers a pending application function call, then emits its item;
        returns the public call_id."""
        ...

    async def wait_function_results(self, call_ids: list[str]) -> list[FunctionResult]:
        """Moves the turn to waiting (session requires_action) until every call
        is answered, records the outputs and resumes the turn."""
        ...

    async def ensure_environment(self) -> None:
        """Before the first environment operation of a turn: pending/ready events
        around setup; raises TurnFailure("sandbox_error") when setup failed."""
        ...

    async def mcp_connect(self, tool: dict[str, Any]) -> McpClient:
        """Connects to the server of an ``mcp`` tool (reusing the session's
        connection) and lists its tools. An environment-origin server is
        started or joined first, which enters the environment's init guard.
        Raises McpUnavailable."""
        ...

    def ending(self) -> None:
        """The model gave its final answer: no tool runs in this turn any
        more, so work that waits for the turn's end (reading its outputs) may
        start while the answer is written."""
        ...

    def sandbox_failure(self, exc: BaseException) -> TurnFailure:
        """A failed environment call (a domain error) as a turn failure
        naming the session and environment."""
        ...

    def record_usage(self, usage: Usage) -> None: ...

    async def schedule_automation(self, schedule: AgentSchedule, tool_call_id: str) -> str:
        """Creates an automation that delivers ``schedule`` back to this
        session (the ``automations`` tool); returns what the model is told.
        Raises a domain error for a schedule the service refuses."""
        ...
