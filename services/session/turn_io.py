"""The ``TurnIO`` the harness runs against, made of parts with one job each:
``TurnWriter`` persists the turn's items and events, ``FunctionCallGate``
registers application function calls and waits for their results,
``TurnEnvironment`` sets the environment up and is the harness's
``EnvironmentPort`` to it, and ``TurnMcp`` connects the turn's MCP servers."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from berth.environment.v1 import environment_pb2
from services.session.agents import AgentConfig
from services.session.automations import Automations
from services.session.environment_client import EnvironmentClient
from services.session.function_call_gate import FunctionCallGate
from services.session.harness.automation_tool import AgentSchedule
from services.session.harness.io import FunctionResult, ItemHandle, McpClient, TurnFailure
from services.session.harness.models.base import Entry, Usage
from services.session.harness.subagents import SubagentPort
from services.session.mcp_connections import McpConnections
from services.session.session_controls import PriceTable, SpendBudget
from services.session.store import Store, Unit
from services.session.turn_environment import TurnEnvironment, sandbox_failure
from services.session.turn_mcp import TurnMcp
from services.session.turn_writer import TurnWriter

__all__ = ["DbTurnIO"]


class DbTurnIO:
    def __init__(
        self,
        store: Store,
        env_client: EnvironmentClient | None,
        *,
        org_id: str,
        session_id: str,
        turn_id: str,
        environment_id: str | None,
        environment: environment_pb2.Environment | None,
        agent_config_json: str,
        transcript: list[tuple[str, list[Entry]]],
        next_output_index: int = 0,
        mcp: McpConnections | None = None,
        vault_ids: list[str] | None = None,
        on_ending: Callable[[], None] | None = None,
        dependency_retry_s: float = 0.0,
        worker_id: str = "",
        usage: dict[str, Any] | None = None,
        subagents: SubagentPort | None = None,
        automations: Automations | None = None,
        budget: SpendBudget | None = None,
        prompt_cache_retention: str | None = None,
        prices: PriceTable | None = None,
    ) -> None:
        self.org_id = org_id
        self._automations = automations
        self.session_id = session_id
        self.prompt_cache_retention = prompt_cache_retention
        self._budget = budget
        self.turn_id = turn_id
        self.environment_id = environment_id
        self.writer = TurnWriter(
            store,
            session_id=session_id,
            turn_id=turn_id,
            agent_config_json=agent_config_json,
            transcript=transcript,
            next_output_index=next_output_index,
            worker_id=worker_id,
            usage=usage,
        )
        self._snapshot = environment
        self.env = (
            TurnEnvironment(
                self.writer,
                env_client,
                environment_id=environment_id,
                environment=environment,
                retry_s=dependency_retry_s,
            )
            if env_client is not None and environment_id
            else None
        )
        self.calls = FunctionCallGate(
            self.writer, org_id=org_id, environment=lambda: self.environment, prices=prices or PriceTable()
        )
        self.mcp = TurnMcp(
            mcp,
            session_id=session_id,
            environment=self.env,
            client=env_client if self.env else None,
            vaults=env_client,
            vault_ids=vault_ids or [],
        )
        self._on_ending = on_ending
        self._subagents = subagents

    # ----- what the runner reads when the turn ends --------------------------------
    @property
    def environment(self) -> environment_pb2.Environment | None:
        """The environment's last snapshot read."""
        return self.env.environment if self.env is not None else self._snapshot

    @property
    def environment_ready(self) -> bool:
        """Whether the environment is known to be ready (setup never undoes that)."""
        return self.env is not None and self.env.ready

    @property
    def usage(self) -> dict[str, Any] | None:
        return self.writer.usage

    @property
    def next_output_index(self) -> int:
        return self.writer.next_output_index

    @property
    def made_function_calls(self) -> bool:
        return self.calls.made_function_calls

    async def settle(self) -> None:
        await self.writer.settle()

    async def close_open_items(self, u: Unit) -> None:
        await self.writer.close_open_items(u)

    # ----- TurnIO -------------------------------------------------------------------
    @property
    def subagents(self) -> SubagentPort | None:
        return self._subagents

    async def agent_config(self) -> AgentConfig:
        # Read before every model call: a session past its budget makes no more.
        if self._budget is not None:
            await self._budget.refresh()
            self._budget.check(self.writer.usage)
        return await self.writer.agent_config()

    async def transcript(self) -> list[Entry]:
        return await self.writer.transcript()

    async def transcript_items(self) -> list[tuple[str, list[Entry]]]:
        return await self.writer.transcript_items()

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
        return await self.writer.add_item(item, entries=entries, output=output, done=done, visible=visible, hold=hold)

    def track_item(self, handle: ItemHandle, item: dict[str, Any]) -> None:
        self.writer.track_item(handle, item)

    async def finish_item(self, handle: ItemHandle, item: dict[str, Any], *, entries: list[Entry], hold: bool = False) -> None:
        await self.writer.finish_item(handle, item, entries=entries, hold=hold)

    def flush_behind(self) -> None:
        self.writer.flush_behind()

    async def written(self) -> None:
        await self.writer.written()

    async def emit(self, *events: dict[str, Any]) -> None:
        await self.writer.emit(*events)

    def batch(self) -> AbstractAsyncContextManager[None]:
        return self.writer.batch()

    def record_usage(self, usage: Usage) -> None:
        self.writer.record_usage(usage)
        # The call that reaches the budget ends the turn before its tool calls run.
        if self._budget is not None:
            self._budget.check(self.writer.usage)

    async def schedule_automation(self, schedule: AgentSchedule, tool_call_id: str) -> str:
        if self._automations is None:
            return "error: automations are not available in this deployment"
        created = await self._automations.create_for_agent(self.org_id, self.session_id, tool_call_id, schedule)
        when = f"on {created.expression!r} ({created.timezone})" if created.expression else f"once at Unix time {created.run_at}"
        return f"scheduled automation {created.id} {when}"

    async def add_function_call(self, name: str, arguments: str, model_call_id: str) -> str:
        return await self.calls.add_function_call(name, arguments, model_call_id)

    async def wait_function_results(self, call_ids: list[str]) -> list[FunctionResult]:
        return await self.calls.wait_function_results(call_ids)

    async def ensure_environment(self) -> None:
        if self.env is not None:
            await self.env.ensure_ready()

    def sandbox_failure(self, exc: BaseException) -> TurnFailure:
        return sandbox_failure(self.environment_id, self.session_id, exc)

    async def mcp_connect(self, tool: dict[str, Any]) -> McpClient:
        return await self.mcp.connect(tool)

    def ending(self) -> None:
        if self._on_ending is not None:
            self._on_ending()
