"""The ``automations`` agent tool: the model schedules its own follow-ups.

Offered when the agent's tools include ``{"type": "automations"}``. A call
creates an automation whose target is the calling session (``created_by``
records the session and the tool call), so the instructions come back to
this session as a user message once at ``run_at`` or ``delay_seconds`` from
now, or on every occurrence of a cron ``expression`` in ``timezone``.
The call and its answer are transcript entries the model sees; the
automation itself is listed by ``automations.list(session_id=...)``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from services.core.errors import BerthError
from services.session.agents import AgentConfig
from services.session.harness.io import TurnIO
from services.session.harness.models.base import ToolCall, ToolSpec
from services.session.harness.tool_output import call_entries

__all__ = ["AUTOMATIONS_TOOL", "AgentSchedule", "automations_enabled", "parse_schedule", "run_automations_tool"]

AUTOMATIONS_TOOL = ToolSpec(
    name="automations",
    description=(
        "Schedule a follow-up for yourself: the instructions are delivered back to this session as a user "
        "message later. Give exactly one of run_at (Unix seconds), delay_seconds, or expression (a five-field "
        "cron expression, evaluated in timezone, default UTC) for a repeating follow-up."
    ),
    parameters={
        "type": "object",
        "properties": {
            "instructions": {"type": "string", "description": "What to do when the follow-up arrives."},
            "name": {"type": "string", "description": "A short name for the automation."},
            "run_at": {"type": "integer", "description": "When to deliver it once, as Unix seconds."},
            "delay_seconds": {"type": "integer", "description": "Deliver it once, this many seconds from now."},
            "expression": {"type": "string", "description": "A cron expression for a repeating follow-up."},
            "timezone": {"type": "string", "description": "The IANA timezone of expression; default UTC."},
        },
        "required": ["instructions"],
    },
)


@dataclass(frozen=True)
class AgentSchedule:
    """What one call asks for: exactly one of ``run_at``, ``delay_seconds``
    (resolved against the schedule's clock) and ``expression``."""

    name: str
    instructions: str
    run_at: int | None = None
    delay_seconds: int | None = None
    expression: str = ""
    timezone: str = "UTC"


def parse_schedule(args: dict[str, Any]) -> AgentSchedule | str:
    """The call's schedule, or the error the model is told."""
    instructions = args.get("instructions")
    if not isinstance(instructions, str) or not instructions.strip():
        return "instructions is required"
    name = args.get("name")
    if not isinstance(name, str) or not name.strip():
        name = instructions.strip().splitlines()[0][:80]
    when = [k for k in ("run_at", "delay_seconds", "expression") if args.get(k) not in (None, "")]
    if len(when) != 1:
        return "give exactly one of run_at, delay_seconds or expression"
    value = args[when[0]]
    if when[0] == "expression":
        timezone = args.get("timezone") or "UTC"
        if not isinstance(value, str) or not isinstance(timezone, str):
            return "expression and timezone must be strings"
        return AgentSchedule(name=name, instructions=instructions, expression=value, timezone=timezone)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        return f"{when[0]} must be a positive integer"
    if when[0] == "run_at":
        return AgentSchedule(name=name, instructions=instructions, run_at=value)
    return AgentSchedule(name=name, instructions=instructions, delay_seconds=value)


def automations_enabled(config: AgentConfig) -> bool:
    return any(t.get("type") == "automations" for t in config.get("tools", []))


async def run_automations_tool(io: TurnIO, call: ToolCall) -> None:
    try:
        value = json.loads(call.arguments or "{}")
    except ValueError:
        value = None
    if not isinstance(value, dict):
        output = f"error: invalid arguments for automations: {call.arguments}"
    else:
        schedule = parse_schedule(value)
        if isinstance(schedule, str):
            output = f"error: {schedule}"
        else:
            try:
                output = await io.schedule_automation(schedule, call.id)
            except BerthError as exc:
                output = f"error: {exc.message}" + (f" ({exc.param})" if exc.param else "")
    await io.add_item(
        {"type": "function_call", "call_id": call.id, "name": call.name, "arguments": call.arguments, "status": "completed"},
        entries=call_entries(call, output),
        output=False,
        done=True,
        visible=False,
    )
