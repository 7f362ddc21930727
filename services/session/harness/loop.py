"""The agent loop of one turn: call the model with the session history and the
tool definitions, execute the tool calls it makes, append items, and repeat
until it answers without tool calls (at most ``MAX_ITERATIONS`` model calls).

The agent's MCP servers are connected before the first model call (a
required one that fails ends the turn); the MCP calls of one model response
run concurrently, everything else in the order the model gave."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.core.logging import get_logger
from services.session.harness.io import TurnFailure, TurnIO
from services.session.harness.models.base import ModelError, ModelProvider, ModelRequest
from services.session.harness.mcp_tools import McpToolbox, is_mcp_call
from services.session.harness.models.base import ToolCall
from services.session.harness.tools import PendingCall, execute_tool_call, tool_specs

__all__ = ["run_turn", "MAX_ITERATIONS"]

log = get_logger(__name__)

MAX_ITERATIONS = 50


async def _emit_message(io: TurnIO, text: str, phase: str) -> None:
    # The text is complete before anything is shown, so the whole item is one write.
    item: dict[str, Any] = {"type": "message", "role": "assistant", "status": "in_progress", "phase": phase, "content": []}
    async with io.batch():
        handle = await io.add_item(item, entries=[], output=True, done=False)
        io.track_item(handle, item)
        scope = {"item_id": handle.id, "output_index": handle.output_index, "content_index": 0}
        await io.emit(
            {"type": "agent.session.turn.content_part.added", **scope, "part": {"type": "output_text", "text": ""}},
            {"type": "agent.session.turn.output_text.delta", **scope, "delta": text},
            {"type": "agent.session.turn.output_text.done", **scope, "text": text},
            {"type": "agent.session.turn.content_part.done", **scope, "part": {"type": "output_text", "text": text}},
        )
        done = {**item, "status": "completed", "content": [{"type": "output_text", "text": text}]}
        await io.finish_item(handle, done, entries=[{"role": "assistant", "text": text}])


async def run_turn(io: TurnIO, provider_for: Callable[[str], ModelProvider]) -> None:
    """Runs until the final answer. Raises TurnFailure for a failed turn;
    cancellation arrives as CancelledError at any await."""
    mcp = McpToolbox()
    for _ in range(MAX_ITERATIONS):
        config = await io.agent_config()
        await mcp.prepare(io, config)
        request = ModelRequest(
            model=config["model"],
            instructions=config.get("instructions"),
            transcript=await io.transcript(),
            tools=tool_specs(config, has_environment=io.environment_id is not None) + mcp.specs(),
            text_format=config.get("text", {}).get("format"),
            reasoning_effort=(config.get("reasoning") or {}).get("effort"),
        )
        try:
            response = await provider_for(config["model"]).complete(request)
        except ModelError as exc:
            raise TurnFailure(exc.code, exc.message) from exc
        if response.usage is not None:
            io.record_usage(response.usage)
        if not response.tool_calls:
            io.ending()
            await _emit_message(io, response.text or "", "final_answer")
            return
        if response.text:
            await _emit_message(io, response.text, "commentary")
        pending: list[PendingCall] = []
        batch: list[ToolCall] = []
        for call in response.tool_calls:
            if is_mcp_call(call.name):
                batch.append(call)
                continue
            if batch:
                await mcp.run(io, batch)
                batch = []
            result = await execute_tool_call(io, config, call)
            if result is not None:
                pending.append(result)
        if batch:
            await mcp.run(io, batch)
        if pending:
            await io.wait_function_results([p.call_id for p in pending])
    raise TurnFailure("internal_error", f"the agent did not finish within {MAX_ITERATIONS} model calls")
