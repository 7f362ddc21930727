"""The agent loop of one turn: call the model with the session history and the
tool definitions, execute the tool calls it makes, append items, and repeat
until it answers without tool calls (at most ``MAX_ITERATIONS`` model calls).
Before each model call the history is compacted when it would not fit the
model's context window (``harness/compaction.py``), and the turn's spans
are recorded (``harness/trace.py``).

Each model call is streamed (``harness/stream.py`` turns its deltas into
items and events as they arrive). The agent's MCP servers are connected
before the first model call (a required one that fails ends the turn). The
tool calls of one model response run concurrently, at most
``tool_concurrency`` at a time; each adds its item only after the call
before it did, so items keep the model's order (output_index)."""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Callable
from typing import Any

from services.core.logging import get_logger
from services.session.agents import AgentConfig
from services.session.harness.compaction import Compactor
from services.session.harness.context import ContextLimits, TokenEstimator
from services.session.harness.io import ItemHandle, TurnFailure, TurnIO
from services.session.harness.mcp_tools import McpToolbox, is_mcp_call
from services.session.harness.models.base import ModelError, ModelProvider, ModelRequest, ModelResponse, ToolCall
from services.session.harness.stream import stream_model_call
from services.session.harness.tools import PendingCall, execute_tool_call, tool_specs
from services.session.harness.trace import TurnTrace

__all__ = ["run_turn", "MAX_ITERATIONS", "DEFAULT_TOOL_CONCURRENCY", "instructions_for"]

log = get_logger(__name__)

MAX_ITERATIONS = 50
DEFAULT_TOOL_CONCURRENCY = 16


def instructions_for(config: AgentConfig, now: datetime.datetime | None = None) -> str | None:
    """The agent's instructions; with ``experimental.time_awareness`` the
    current time (UTC) is added, fresh for every model call."""
    instructions = config.get("instructions")
    if not (config.get("experimental") or {}).get("time_awareness"):
        return instructions
    moment = (now or datetime.datetime.now(datetime.UTC)).replace(microsecond=0)
    note = f"The current date and time is {moment.isoformat().replace('+00:00', 'Z')} (UTC)."
    return f"{instructions}\n\n{note}" if instructions else note


def _unless(value: Any, default: str) -> str | None:
    """``value``, or None when it is unset or the default."""
    return str(value) if value not in (None, "", default) else None


class _Ordered:
    """The TurnIO of one tool call of a concurrent batch: the call's first
    item is added only after the previous call added its first item (or
    finished without one), and environment setup is entered one call at a
    time. The finished items of the batch's last call to end are held, for
    ``flush_behind`` to persist while the next model request goes out.
    Everything else passes through."""

    def __init__(self, io: TurnIO, previous: asyncio.Event | None, setup: asyncio.Lock, last: Callable[[], bool]) -> None:
        self._io = io
        self._previous = previous
        self._setup = setup
        self._last = last
        self.added = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._io, name)

    async def _turn(self) -> None:
        if self._previous is not None and not self.added.is_set():
            await self._previous.wait()

    async def add_item(
        self,
        item: dict[str, Any],
        *,
        entries: list[Any],
        output: bool,
        done: bool,
        visible: bool = True,
        hold: bool = False,
    ) -> ItemHandle:
        await self._turn()
        try:
            hold = hold or (done and self._last())
            return await self._io.add_item(item, entries=entries, output=output, done=done, visible=visible, hold=hold)
        finally:
            self.added.set()

    async def finish_item(self, handle: ItemHandle, item: dict[str, Any], *, entries: list[Any], hold: bool = False) -> None:
        await self._io.finish_item(handle, item, entries=entries, hold=hold or self._last())

    async def add_function_call(self, name: str, arguments: str, model_call_id: str) -> str:
        await self._turn()
        try:
            return await self._io.add_function_call(name, arguments, model_call_id)
        finally:
            self.added.set()

    async def ensure_environment(self) -> None:
        async with self._setup:
            await self._io.ensure_environment()


async def _run_tool_calls(
    io: TurnIO, config: AgentConfig, mcp: McpToolbox, calls: list[ToolCall], concurrency: int, trace: TurnTrace
) -> list[PendingCall]:
    """Runs the calls of one model response; returns the pending
    application function calls, in order."""
    limit = asyncio.Semaphore(max(1, concurrency))
    setup = asyncio.Lock()
    previous: asyncio.Event | None = None
    previous_started: asyncio.Event | None = None
    tasks: list[asyncio.Task[PendingCall | None]] = []
    unfinished = len(calls)

    def last() -> bool:
        return unfinished == 1

    async def one(call: ToolCall, ordered: _Ordered, wait_start: asyncio.Event | None, started: asyncio.Event) -> PendingCall | None:
        # Slots are taken in the model's order, so a call never holds one
        # while waiting for an earlier call that has none.
        if wait_start is not None:
            await wait_start.wait()
        async with limit:
            started.set()
            try:
                with trace.span(
                    "tool",
                    f"execute_tool {call.name}",
                    gen_ai__operation__name="execute_tool",
                    gen_ai__tool__name=call.name,
                    gen_ai__tool__call__id=call.id,
                ):
                    if is_mcp_call(call.name):
                        await mcp.run(ordered, [call])
                        return None
                    return await execute_tool_call(ordered, config, call)
            finally:
                nonlocal unfinished
                unfinished -= 1
                ordered.added.set()

    for call in calls:
        ordered = _Ordered(io, previous, setup, last)
        started = asyncio.Event()
        tasks.append(asyncio.create_task(one(call, ordered, previous_started, started), name=f"tool-{call.id}"))
        previous, previous_started = ordered.added, started
    try:
        results = await asyncio.gather(*tasks)
    except BaseException:
        # A failure (or cancel) of one call ends the others before it is raised.
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
        raise
    io.flush_behind()
    return [r for r in results if r is not None]


async def _call_model(
    io: TurnIO, provider: ModelProvider, request: ModelRequest, compactor: Compactor, trace: TurnTrace
) -> ModelResponse:
    """One model call, traced; a context-length error compacts the history
    and retries once."""
    for attempt in range(2):
        try:
            with trace.span(
                "model", f"chat {request.model}", gen_ai__operation__name="chat", gen_ai__request__model=request.model
            ) as span:
                response = await stream_model_call(io, provider, request)
                if response.usage is not None:
                    span.set(
                        gen_ai__usage__input_tokens=response.usage.input_tokens,
                        gen_ai__usage__output_tokens=response.usage.output_tokens,
                    )
                return response
        except ModelError as exc:
            compacted = None
            if exc.code == "context_length_exceeded" and attempt == 0:
                compacted = await compactor.overflowed(request)
            if compacted is None:
                raise TurnFailure(exc.code, exc.message) from exc
            request = compacted
    raise AssertionError("unreachable")


async def run_turn(
    io: TurnIO,
    provider_for: Callable[[str], ModelProvider],
    *,
    tool_concurrency: int = DEFAULT_TOOL_CONCURRENCY,
    limits: ContextLimits | None = None,
    trace: TurnTrace | None = None,
    estimator: TokenEstimator | None = None,
) -> None:
    """Runs until the final answer. Raises TurnFailure for a failed turn;
    cancellation arrives as CancelledError at any await. Compaction
    (``harness/compaction.py``) keeps each request within the model's
    context window, sized by ``estimator`` (the session's, kept between
    turns; a new one if none); ``trace`` records the turn's spans."""
    trace = trace or TurnTrace(session_id=io.session_id, turn_id=io.turn_id)
    compactor = Compactor(io, provider_for, limits or ContextLimits(), trace, estimator)
    try:
        await _iterate(io, provider_for, tool_concurrency, compactor, trace)
        # The last tool results may still be being written: the turn has
        # not succeeded until they are.
        await io.written()
    except BaseException:
        compactor.cancel()
        raise
    await compactor.settle()


async def _iterate(
    io: TurnIO,
    provider_for: Callable[[str], ModelProvider],
    tool_concurrency: int,
    compactor: Compactor,
    trace: TurnTrace,
) -> None:
    mcp = McpToolbox()
    for _ in range(MAX_ITERATIONS):
        config = await io.agent_config()
        await mcp.prepare(io, config)
        reasoning = config.get("reasoning") or {}
        request = ModelRequest(
            model=config["model"],
            instructions=instructions_for(config),
            transcript=await io.transcript(),
            tools=tool_specs(config, has_environment=io.environment_id is not None) + mcp.specs(),
            text_format=config.get("text", {}).get("format"),
            reasoning_effort=reasoning.get("effort"),
            reasoning_summary=reasoning.get("summary"),
            service_tier=_unless(config.get("service_tier"), "auto"),
            verbosity=_unless((config.get("text") or {}).get("verbosity"), "medium"),
            prompt_cache_retention=io.prompt_cache_retention,
            prompt_cache_key=io.session_id if io.prompt_cache_retention else None,
        )
        request = await compactor.fit(config, request)
        response = await _call_model(io, provider_for(config["model"]), request, compactor, trace)
        if response.usage is not None:
            io.record_usage(response.usage)
            compactor.observe(response.usage)
        if not response.tool_calls:
            return
        pending = await _run_tool_calls(io, config, mcp, response.tool_calls, tool_concurrency, trace)
        if pending:
            with trace.span("wait", "wait function_results", berth__wait_for="function_results"):
                await io.wait_function_results([p.call_id for p in pending])
    raise TurnFailure("internal_error", f"the agent did not finish within {MAX_ITERATIONS} model calls")
