"""One streamed model call as items and events, written as the deltas arrive.

- Reasoning becomes a ``reasoning`` item per reasoning block of the
  response: ``reasoning_summary_part.added``, ``reasoning_summary_text.delta``
  per chunk, then ``..text.done`` and ``..part.done`` per summary part. A
  block without summary text (only an ID or encrypted content, given back
  to the model) is an invisible item.
- Text becomes one assistant ``message`` item: ``content_part.added``, an
  ``output_text.delta`` per chunk, ``output_text.done`` and
  ``content_part.done``. Its ``phase`` is unset while it streams and
  ``commentary`` (tool calls follow) or ``final_answer`` when done.
- A retry of the model call is announced with an ``error`` event of type
  ``model_retrying`` (see docs/wire-contract.md); the turn goes on.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from services.session.harness.io import ItemHandle, TurnIO
from services.session.harness.models.base import (
    Completed,
    ModelError,
    ModelProvider,
    ModelRequest,
    ModelResponse,
    Reasoning,
    ReasoningDelta,
    Retrying,
    TextDelta,
)

__all__ = ["stream_model_call", "RETRYING_ERROR_TYPE"]

RETRYING_ERROR_TYPE = "model_retrying"


@dataclass
class _OpenReasoning:
    handle: ItemHandle
    parts: list[str] = field(default_factory=list)
    # The last part's done events were emitted (the message began).
    parts_done: bool = False

    def scope(self, summary_index: int) -> dict[str, Any]:
        return {"item_id": self.handle.id, "output_index": self.handle.output_index, "summary_index": summary_index}


class _Writer:
    def __init__(self, io: TurnIO) -> None:
        self.io = io
        self.message: ItemHandle | None = None
        self.text: list[str] = []
        self.reasoning: dict[int, _OpenReasoning] = {}

    # ----- reasoning ---------------------------------------------------------------
    async def reasoning_delta(self, delta: ReasoningDelta) -> None:
        if delta.reasoning_index not in self.reasoning:
            async with self.io.batch():
                item = {"type": "reasoning", "summary": [], "status": "in_progress"}
                handle = await self.io.add_item(item, entries=[], output=True, done=False)
                self.reasoning[delta.reasoning_index] = _OpenReasoning(handle)
                await self._reasoning(delta)
        else:
            await self._reasoning(delta)

    async def _reasoning(self, delta: ReasoningDelta) -> None:
        io = self.io
        block = self.reasoning[delta.reasoning_index]
        events: list[dict[str, Any]] = []
        block.parts_done = False
        while len(block.parts) <= delta.summary_index:
            if block.parts:
                events.extend(self._part_done(block, len(block.parts) - 1))
            block.parts.append("")
            events.append(
                {
                    "type": "agent.session.turn.reasoning_summary_part.added",
                    **block.scope(len(block.parts) - 1),
                    "part": {"type": "summary_text", "text": ""},
                }
            )
        block.parts[delta.summary_index] += delta.text
        events.append(
            {"type": "agent.session.turn.reasoning_summary_text.delta", **block.scope(delta.summary_index), "delta": delta.text}
        )
        io.track_item(block.handle, self._reasoning_item(block.parts, "in_progress"))
        await io.emit(*events)

    def _part_done(self, block: _OpenReasoning, index: int) -> list[dict[str, Any]]:
        text = block.parts[index]
        return [
            {"type": "agent.session.turn.reasoning_summary_text.done", **block.scope(index), "text": text},
            {
                "type": "agent.session.turn.reasoning_summary_part.done",
                **block.scope(index),
                "part": {"type": "summary_text", "text": text},
            },
        ]

    @staticmethod
    def _reasoning_item(parts: list[str], status: str) -> dict[str, Any]:
        return {"type": "reasoning", "summary": [{"type": "summary_text", "text": p} for p in parts], "status": status}

    async def end_parts(self) -> None:
        """Ends the last summary part of every open reasoning item."""
        events: list[dict[str, Any]] = []
        for block in self.reasoning.values():
            if block.parts and not block.parts_done:
                events.extend(self._part_done(block, len(block.parts) - 1))
                block.parts_done = True
        if events:
            await self.io.emit(*events)

    async def finish_reasoning(self, final: list[Reasoning]) -> None:
        """Finishes the reasoning items with the response's final reasoning
        (what is given back to the model) and adds the blocks that streamed
        nothing."""
        io = self.io
        await self.end_parts()
        for index, block in sorted(self.reasoning.items()):
            result = final[index] if index < len(final) else Reasoning(summary=list(block.parts))
            parts = result.summary or block.parts
            await io.finish_item(block.handle, self._reasoning_item(parts, "completed"), entries=[result.as_entry()])
        for index, result in enumerate(final):
            if index in self.reasoning:
                continue
            item = self._reasoning_item(result.summary, "completed")
            await io.add_item(item, entries=[result.as_entry()], output=True, done=True, visible=bool(result.summary))

    # ----- text --------------------------------------------------------------------
    def _scope(self) -> dict[str, Any]:
        assert self.message is not None
        return {"item_id": self.message.id, "output_index": self.message.output_index, "content_index": 0}

    async def open_message(self) -> None:
        item: dict[str, Any] = {"type": "message", "role": "assistant", "status": "in_progress", "phase": None, "content": []}
        self.message = await self.io.add_item(item, entries=[], output=True, done=False)
        await self.io.emit(
            {"type": "agent.session.turn.content_part.added", **self._scope(), "part": {"type": "output_text", "text": ""}}
        )

    async def text_delta(self, text: str) -> None:
        if self.message is None:
            # The item, its first part and the first delta are one write:
            # nothing else writes while the model streams.
            async with self.io.batch():
                await self.end_parts()
                await self.open_message()
                await self._text(text)
        else:
            await self._text(text)

    async def _text(self, text: str) -> None:
        assert self.message is not None
        self.text.append(text)
        self.io.track_item(
            self.message,
            {
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "phase": None,
                "content": [{"type": "output_text", "text": "".join(self.text)}],
            },
        )
        await self.io.emit({"type": "agent.session.turn.output_text.delta", **self._scope(), "delta": text})

    async def finish_message(self, response: ModelResponse) -> None:
        final = not response.tool_calls
        streamed = "".join(self.text)
        text = response.text if response.text is not None else streamed
        if self.message is None and not text and not final:
            return
        if final:
            self.io.ending()
        async with self.io.batch():
            if self.message is None:
                await self.open_message()
            events: list[dict[str, Any]] = []
            if text.startswith(streamed) and len(text) > len(streamed):
                events.append({"type": "agent.session.turn.output_text.delta", **self._scope(), "delta": text[len(streamed) :]})
            events += [
                {"type": "agent.session.turn.output_text.done", **self._scope(), "text": text},
                {"type": "agent.session.turn.content_part.done", **self._scope(), "part": {"type": "output_text", "text": text}},
            ]
            await self.io.emit(*events)
            assert self.message is not None
            done = {
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "phase": "final_answer" if final else "commentary",
                "content": [{"type": "output_text", "text": text}],
            }
            await self.io.finish_item(self.message, done, entries=[{"role": "assistant", "text": text}])


def _retrying_event(retry: Retrying) -> dict[str, Any]:
    return {
        "type": "error",
        "error": {
            "type": RETRYING_ERROR_TYPE,
            "code": retry.code,
            "message": f"{retry.message}; retrying in {retry.delay_s:.1f} s (retry {retry.attempt})",
            "param": None,
        },
    }


async def stream_model_call(io: TurnIO, provider: ModelProvider, request: ModelRequest) -> ModelResponse:
    """Streams one model call into items and events; returns the complete
    response. A failure leaves open items to the turn's end (incomplete)."""
    writer = _Writer(io)
    response: ModelResponse | None = None
    async with contextlib.aclosing(provider.stream(request)) as events:  # type: ignore[type-var]
        async for event in events:
            if isinstance(event, TextDelta):
                if event.text:
                    await writer.text_delta(event.text)
            elif isinstance(event, ReasoningDelta):
                if event.text:
                    await writer.reasoning_delta(event)
            elif isinstance(event, Retrying):
                await io.emit(_retrying_event(event))
            elif isinstance(event, Completed):
                response = event.response
    if response is None:
        raise ModelError("server_error", "the model stream ended without a response")
    await writer.finish_reasoning(response.reasoning)
    await writer.finish_message(response)
    return response
