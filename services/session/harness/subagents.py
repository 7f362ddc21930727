"""The subagent tools (``multi_agent``): the model creates subagents, sends
them input, waits for them, interrupts, resumes and closes them.

Each call is one item of the SDK's matching type (``create_subagent_call``,
``send_subagent_input_call``, ``wait_for_subagents_call``,
``interrupt_subagent_call``, ``resume_subagent_call``,
``close_subagent_call``): added ``in_progress`` when the call starts and
finished ``completed`` or ``failed``; the model reads the outcome as the
tool's output. The subagents themselves run as child sessions of the
service (``services/session/subagents.py``), reached through the
``SubagentPort`` of the turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from services.session.harness.io import TurnIO
from services.session.harness.models.base import ToolCall, ToolSpec
from services.session.harness.tool_output import call_entries, clip_for_model

__all__ = [
    "SubagentPort",
    "SubagentRefused",
    "SubagentState",
    "SUBAGENT_TOOLS",
    "DEFAULT_WAIT_MS",
    "MAX_WAIT_MS",
    "run_subagent_tool",
]

DEFAULT_WAIT_MS = 5 * 60 * 1000
MAX_WAIT_MS = 30 * 60 * 1000


class SubagentRefused(Exception):
    """The call cannot be carried out (an unknown or closed subagent, the
    concurrency bound reached); the model is told why."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class SubagentState:
    """Where a subagent is: ``status`` is ``active`` or ``closed``;
    ``running`` while a turn of it is queued or running; ``last_turn`` is
    the status of its latest turn (None before any) and ``answer`` that
    turn's final assistant message."""

    id: str
    status: str
    running: bool
    last_turn: str | None
    answer: str | None


class SubagentPort(Protocol):
    """The subagents of the session a turn runs in, as the calling agent
    (``agent_id``) sees them."""

    @property
    def agent_id(self) -> str: ...

    async def create(self, task: str, *, name: str | None, model: str | None, reasoning_effort: str | None) -> str:
        """Creates a subagent and starts its first turn with ``task``; returns its ID."""
        ...

    async def send_input(self, subagent_id: str, text: str) -> None:
        """Queues a turn of the subagent with ``text``."""
        ...

    async def wait(self, subagent_ids: list[str], timeout_s: float) -> list[SubagentState]:
        """Returns once none of the subagents is running, or the timeout passed."""
        ...

    async def interrupt(self, subagent_id: str) -> None: ...

    async def resume(self, subagent_id: str) -> None: ...

    async def close(self, subagent_id: str) -> None: ...


def _object(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required}


_ID = {"type": "string", "description": "The subagent's ID, as create_subagent returned it."}

SUBAGENT_TOOLS = [
    ToolSpec(
        name="create_subagent",
        description=(
            "Create a subagent: an agent with its own history that works on the same environment (files and "
            "processes are shared) and starts on the task at once. Returns its ID; use wait_for_subagents for its answer."
        ),
        parameters=_object(
            {
                "task": {"type": "string", "description": "The task, as the subagent's first message."},
                "name": {"type": "string", "description": "A short nickname."},
                "model": {"type": "string", "description": "The model; default the same as yours."},
                "reasoning_effort": {"type": "string", "description": "The reasoning effort; default the same as yours."},
            },
            ["task"],
        ),
    ),
    ToolSpec(
        name="send_subagent_input",
        description="Send a message to a subagent; it works on it after its current turn.",
        parameters=_object({"subagent_id": _ID, "message": {"type": "string", "description": "The message."}}, ["subagent_id", "message"]),
    ),
    ToolSpec(
        name="wait_for_subagents",
        description="Wait until the given subagents are idle, and return each one's status and latest answer.",
        parameters=_object(
            {
                "subagent_ids": {"type": "array", "items": {"type": "string"}, "description": "The subagents."},
                "timeout_ms": {"type": "integer", "description": f"How long to wait at most; default {DEFAULT_WAIT_MS}."},
            },
            ["subagent_ids"],
        ),
    ),
    ToolSpec(
        name="interrupt_subagent",
        description="Stop a subagent's running turn (its side effects stay). It can take input again.",
        parameters=_object({"subagent_id": _ID}, ["subagent_id"]),
    ),
    ToolSpec(
        name="resume_subagent",
        description="Reopen a closed subagent, with its history.",
        parameters=_object({"subagent_id": _ID}, ["subagent_id"]),
    ),
    ToolSpec(
        name="close_subagent",
        description="Close a subagent (a running turn is interrupted); it no longer counts toward the limit.",
        parameters=_object({"subagent_id": _ID}, ["subagent_id"]),
    ),
]

_RECIPIENT_CALLS = {
    "interrupt_subagent": "interrupt_subagent_call",
    "resume_subagent": "resume_subagent_call",
    "close_subagent": "close_subagent_call",
}


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _content(text: str) -> list[dict[str, Any]]:
    return [{"type": "output_text", "text": text}]


def _optional(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _report(states: list[SubagentState]) -> str:
    lines = []
    for s in states:
        state = "running" if s.running else (s.last_turn or "idle")
        lines.append(f"subagent {s.id} ({s.status}): {state}")
        if s.answer:
            lines.append(s.answer)
    return "\n".join(lines)


def _item(call: ToolCall, port: SubagentPort | None, args: dict[str, Any]) -> dict[str, Any]:
    """The call's item, in progress, in the SDK's shape for its type."""
    sender = port.agent_id if port is not None else ""
    if call.name == "create_subagent":
        return {
            "type": "create_subagent_call",
            "agent_id": sender,
            "content": _content(_text(args.get("task"))),
            "model": _optional(args.get("model")),
            "reasoning_effort": _optional(args.get("reasoning_effort")),
            "status": "in_progress",
        }
    if call.name == "send_subagent_input":
        return {
            "type": "send_subagent_input_call",
            "recipient_agent_id": _text(args.get("subagent_id")),
            "sender_agent_id": sender,
            "content": _content(_text(args.get("message"))),
            "status": "in_progress",
        }
    if call.name == "wait_for_subagents":
        ids = args.get("subagent_ids")
        return {
            "type": "wait_for_subagents_call",
            "recipient_agent_ids": [i for i in ids if isinstance(i, str)] if isinstance(ids, list) else [],
            "sender_agent_id": sender,
            "status": "in_progress",
        }
    return {
        "type": _RECIPIENT_CALLS[call.name],
        "recipient_agent_id": _text(args.get("subagent_id")),
        "sender_agent_id": sender,
        "status": "in_progress",
    }


async def _perform(port: SubagentPort, call: ToolCall, item: dict[str, Any], args: dict[str, Any]) -> str:
    """Carries the call out; returns what the model is told."""
    if call.name == "create_subagent":
        task = item["content"][0]["text"]
        if not task.strip():
            raise SubagentRefused("create_subagent needs a non-empty task")
        subagent_id = await port.create(
            task, name=_optional(args.get("name")), model=item["model"], reasoning_effort=item["reasoning_effort"]
        )
        return f"subagent_id: {subagent_id}"
    if call.name == "wait_for_subagents":
        ids = item["recipient_agent_ids"]
        if not ids:
            raise SubagentRefused("wait_for_subagents needs at least one subagent_id")
        timeout = args.get("timeout_ms")
        timeout_ms = min(timeout, MAX_WAIT_MS) if isinstance(timeout, int) and timeout > 0 else DEFAULT_WAIT_MS
        return _report(await port.wait(ids, timeout_ms / 1000))
    recipient = item["recipient_agent_id"]
    if not recipient:
        raise SubagentRefused(f"{call.name} needs a subagent_id")
    if call.name == "send_subagent_input":
        message = item["content"][0]["text"]
        if not message.strip():
            raise SubagentRefused("send_subagent_input needs a non-empty message")
        await port.send_input(recipient, message)
        return f"sent to subagent {recipient}"
    if call.name == "interrupt_subagent":
        await port.interrupt(recipient)
        return f"interrupted subagent {recipient}"
    if call.name == "resume_subagent":
        await port.resume(recipient)
        return f"resumed subagent {recipient}"
    await port.close(recipient)
    return f"closed subagent {recipient}"


async def run_subagent_tool(io: TurnIO, port: SubagentPort | None, call: ToolCall) -> None:
    """Runs one subagent tool call to its finished item."""
    # A trace span for the subagent call (issue 15, traces) wraps this function.
    try:
        parsed = json.loads(call.arguments or "{}")
    except ValueError:
        parsed = None
    args: dict[str, Any] = parsed if isinstance(parsed, dict) else {}
    item = _item(call, port, args)
    if port is None:
        message = "error: subagents are not enabled for this agent"
        await io.add_item({**item, "status": "failed"}, entries=call_entries(call, message), output=True, done=True)
        return
    if parsed is None or not isinstance(parsed, dict):
        message = f"error: invalid arguments for {call.name}: {call.arguments}"
        await io.add_item({**item, "status": "failed"}, entries=call_entries(call, message), output=True, done=True)
        return
    handle = await io.add_item(item, entries=call_entries(call, "")[:1], output=True, done=False)
    io.track_item(handle, item)
    try:
        output = await _perform(port, call, item, args)
        item["status"] = "completed"
    except SubagentRefused as exc:
        output = f"error: {exc.message}"
        item["status"] = "failed"
    await io.finish_item(handle, item, entries=call_entries(call, clip_for_model(output)))
