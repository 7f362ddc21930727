"""Context compaction: before a model call would overflow the model's
context window, the older part of the history is replaced by a summary the
model writes of it.

How much a request fills is the larger of its estimate
(``context.TokenEstimator``) and what the model reported for the previous
call. Past ``threshold`` of the window the compaction is blocking: the
model call waits for it. With the agent's ``compaction.async`` it starts in
the background already at three quarters of that, while the turn goes on;
a call that reaches the threshold before it finished waits for it, and the
turn's end does too (so the next turn starts compacted).

A compaction keeps the newest items that fit in a quarter of the window as
they are, asks the model (no tools) to summarize everything before them,
and adds the summary as a ``reasoning`` item carrying ``compaction``
(``context.compaction_entry`` is what the model sees of it). A summarizing
call that fails leaves the history as it was; a context-length error of
the next model call then fails the turn."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from services.core.logging import get_logger
from services.session.agents import AgentConfig
from services.session.harness.context import ContextLimits, TokenEstimator, compaction_entry
from services.session.harness.io import TurnIO
from services.session.harness.models.base import Entry, ModelError, ModelProvider, ModelRequest, Usage, complete
from services.session.harness.trace import TurnTrace

__all__ = ["Compactor", "SUMMARY_PROMPT", "SUMMARY_PREFIX"]

log = get_logger(__name__)

SUMMARY_PROMPT = (
    "Your context window is nearly full, so the conversation so far will be replaced by a summary you write now. "
    "Write a handoff note from which you can continue the work without the conversation: the user's requests and "
    "constraints, what has been done and decided, the state of files, commands and processes that matter, what "
    "failed and why, and the next steps. Be concise and specific (names, paths, values); do not call tools."
)
SUMMARY_PREFIX = (
    "[Context compacted] The earlier part of this session was replaced by this summary of it, written by you:\n\n"
)

# Of the window: the newest items kept verbatim, the summary's own bound,
# and what the summarizing request may fill.
_KEEP_FRACTION = 0.25
_SUMMARY_FRACTION = 0.2
_REQUEST_FRACTION = 0.9
_ASYNC_START = 0.75


class Compactor:
    """The compactions of one turn."""

    def __init__(
        self,
        io: TurnIO,
        provider_for: Callable[[str], ModelProvider],
        limits: ContextLimits,
        trace: TurnTrace,
        estimator: TokenEstimator | None = None,
    ) -> None:
        self.io = io
        self.provider_for = provider_for
        self.limits = limits
        self.trace = trace
        self._reported = 0
        self._background: asyncio.Task[bool] | None = None
        self._estimate = estimator or TokenEstimator()

    def observe(self, usage: Usage) -> None:
        """The model's own count of the last call's context."""
        self._reported = usage.input_tokens + usage.output_tokens

    def used(self, request: ModelRequest) -> int:
        return max(self._estimate.request(request), self._reported)

    async def fit(self, config: AgentConfig, request: ModelRequest) -> ModelRequest:
        """``request``, with a compacted transcript when it needed one."""
        window = self.limits.window(request.model)
        limit = int(window * self.limits.threshold)
        used = self.used(request)
        background = bool((config.get("compaction") or {}).get("async"))
        if self._background is not None and self._background.done():
            # Finished while the turn went on (already applied): collect it.
            self._background.result()
            self._background = None
        if background and self._background is None and used >= int(limit * _ASYNC_START):
            self._background = asyncio.create_task(self.compact(request, used, background=True), name="compaction")
        if used < limit:
            return request
        if self._background is not None:
            with self.trace.span("wait", "wait compaction", berth__wait_for="compaction"):
                await asyncio.shield(self._background)
            self._background = None
            request = await self._refreshed(request)
            if self.used(request) < limit:
                return request
        if await self.compact(request, used, background=False):
            request = await self._refreshed(request)
        return request

    async def _refreshed(self, request: ModelRequest) -> ModelRequest:
        return dataclasses.replace(request, transcript=await self.io.transcript())

    async def overflowed(self, request: ModelRequest) -> ModelRequest | None:
        """After the model refused ``request`` as too long: the request
        compacted, or None when nothing could be compacted."""
        await self.settle()
        # The window is smaller than configured: size everything by what was refused.
        refused = min(self.used(request), self.limits.window(request.model))
        if not await self.compact(request, refused, background=False, room=refused):
            return None
        return await self._refreshed(request)

    async def settle(self) -> None:
        """Waits for a background compaction (at the turn's end)."""
        if self._background is not None:
            with self.trace.span("wait", "wait compaction", berth__wait_for="compaction"):
                await asyncio.shield(self._background)
            self._background = None

    def cancel(self) -> None:
        if self._background is not None:
            self._background.cancel()
            self._background = None

    async def compact(self, request: ModelRequest, used: int, *, background: bool, room: int | None = None) -> bool:
        """Summarizes the older items; returns whether the history changed.
        ``room`` is the context the model has, when less than its window."""
        window = min(self.limits.window(request.model), room or self.limits.window(request.model))
        items = await self.io.transcript_items()
        cut, kept = len(items), 0
        for index in range(len(items) - 1, -1, -1):
            cost = self._estimate.entries(items[index][1])
            if kept + cost > window * _KEEP_FRACTION:
                break
            kept, cut = kept + cost, index
        summarized = items[:cut]
        if len(summarized) < 2:
            # One item (the first message, say) is no shorter as a summary.
            return False
        with self.trace.span(
            "compaction",
            "compaction",
            berth__compaction__items=len(summarized),
            berth__compaction__tokens_before=used,
            berth__compaction__background=background,
        ) as span:
            fixed = self._estimate.request(dataclasses.replace(request, tools=[], transcript=[]))
            # Reasoning is the model's own, and an API may refuse it out of its context.
            summarizable = [e for _, es in summarized for e in es if "reasoning" not in e]
            entries = _fit(summarizable, int(window * _REQUEST_FRACTION) - fixed, self._estimate)
            ask = ModelRequest(
                model=request.model,
                instructions=request.instructions,
                transcript=[*entries, {"role": "user", "text": SUMMARY_PROMPT}],
                tools=[],
            )
            try:
                response = await complete(self.provider_for(request.model), ask)
            except ModelError as exc:
                span.fail(exc.code)
                log.warning("compaction_failed", code=exc.code, background=background)
                return False
            if response.usage is not None:
                self.io.record_usage(response.usage)
                span.set(gen_ai__usage__input_tokens=response.usage.input_tokens,
                         gen_ai__usage__output_tokens=response.usage.output_tokens)
            summary = (response.text or "").strip()[: int(window * _SUMMARY_FRACTION) * 4]
            if not summary:
                span.fail("empty_summary")
                return False
            item = {
                "type": "reasoning",
                "status": "completed",
                "summary": [{"type": "summary_text", "text": summary}],
                "compaction": {"summarized_items": len(summarized), "tokens_before": used, "background": background},
            }
            # Kept: what followed the summarized items, including what the
            # turn added meanwhile (read just before the item is staged).
            summarized_ids = {item_id for item_id, _ in summarized}
            keep = [item_id for item_id, _ in await self.io.transcript_items() if item_id not in summarized_ids]
            await self.io.add_item(
                item, entries=[compaction_entry(SUMMARY_PREFIX + summary, keep)], output=True, done=True
            )
        self._reported = 0
        log.info("context_compacted", items=len(summarized), tokens_before=used, background=background)
        return True


def _fit(entries: list[Entry], budget: int, estimate: TokenEstimator) -> list[Entry]:
    """The newest ``entries`` whose estimate fits ``budget``."""
    total, start = 0, len(entries)
    for index in range(len(entries) - 1, -1, -1):
        total += estimate.entries([entries[index]])
        if total > budget:
            break
        start = index
    return entries[start:]
