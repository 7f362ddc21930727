"""The tool calls of one model response run concurrently up to the bound,
and their items are added in the model's order whatever order they start
work in. Over a minimal in-memory TurnIO and environment port."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from services.session.harness.environment import CommandEvent, CommandExit, CommandOutput
from services.session.harness.io import ItemHandle
from services.session.harness.loop import _run_tool_calls
from services.session.harness.mcp_tools import McpToolbox
from services.session.harness.models.base import ToolCall
from services.session.harness.trace import TurnTrace


class _Env:
    def __init__(self) -> None:
        self.active = 0
        self.most = 0

    async def exec(self, shell: str, *, cwd: str, timeout_ms: int, key: str = "") -> AsyncGenerator[CommandEvent, None]:
        self.active += 1
        self.most = max(self.most, self.active)
        try:
            # Simulated work: later calls finish first.
            await asyncio.sleep(float(shell))
            yield CommandOutput(shell.encode())
            yield CommandExit(exit_code=0, timed_out=False, duration_ms=1)
        finally:
            self.active -= 1


class _IO:
    session_id = "sess_1"
    prompt_cache_retention: str | None = None
    turn_id = "turn_1"
    environment_id = "env_1"

    def __init__(self) -> None:
        self.env = _Env()
        self.items: list[tuple[int | None, dict[str, Any]]] = []
        self.setups = 0
        self._next = 0

    async def add_item(
        self, item: dict[str, Any], *, entries: list[Any], output: bool, done: bool, visible: bool = True, hold: bool = False
    ) -> ItemHandle:
        handle = ItemHandle(f"item_{self._next}", self._next if output else None)
        self._next += 1
        self.items.append((handle.output_index, dict(item)))
        return handle

    def track_item(self, handle: ItemHandle, item: dict[str, Any]) -> None:
        return None

    async def finish_item(self, handle: ItemHandle, item: dict[str, Any], *, entries: list[Any], hold: bool = False) -> None:
        return None

    def flush_behind(self) -> None:
        return None

    async def written(self) -> None:
        return None

    async def emit(self, *events: dict[str, Any]) -> None:
        return None

    async def ensure_environment(self) -> None:
        self.setups += 1
        await asyncio.sleep(0)


def _calls(*seconds: float) -> list[ToolCall]:
    return [ToolCall(f"call_{n}", "exec_command", json.dumps({"command": str(s)})) for n, s in enumerate(seconds)]


@pytest.mark.parametrize(("bound", "most"), [(1, 1), (2, 2), (8, 4)])
async def test_tool_calls_run_at_most_bound_at_a_time_and_add_items_in_the_models_order(bound: int, most: int) -> None:
    io = _IO()
    config: Any = {"model": "m", "tools": []}
    async with asyncio.timeout(10):
        trace = TurnTrace(session_id="sess", turn_id="turn")
        pending = await _run_tool_calls(io, config, McpToolbox(), _calls(0.08, 0.04, 0.02, 0.0), bound, trace)  # type: ignore[arg-type]
    assert pending == []
    assert io.env.most == most
    assert [item["command"] for _, item in io.items] == ["0.08", "0.04", "0.02", "0.0"]
    assert [index for index, _ in io.items] == [0, 1, 2, 3]
    # One tool span per call, each a child of the turn.
    assert sorted(str(s.attributes["gen_ai.tool.call.id"]) for s in trace.spans if s.kind == "tool") == [c.id for c in _calls(0, 0, 0, 0)]
