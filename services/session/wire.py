"""The stored JSON of turns, usage and events, as the converter
(services/core/wire_json.py) maps it onto the contract messages.

Every function returns a plain dict in the shape of the SDK model named in
its docstring. Sessions and environments are not rendered here: session
events carry the typed ``Session`` and the gateway renders it.
"""

from __future__ import annotations

import json
from typing import Any

from berth.session.v1 import session_pb2
from services.core.wire_json import to_wire
from services.session.states import SessionStatus, session_status_to_proto

__all__ = [
    "usage",
    "add_usage",
    "parse_usage",
    "render_turn",
    "environment_state",
    "session_event",
    "turn_event",
    "environment_event",
    "error_event",
    "without_secrets",
    "legacy_status_event",
]


def usage(input_tokens: int = 0, output_tokens: int = 0, cached_tokens: int = 0, reasoning_tokens: int = 0) -> dict[str, Any]:
    """`TokenUsage`."""
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }


def add_usage(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    if a is None:
        return b
    if b is None:
        return a
    return usage(
        a["input_tokens"] + b["input_tokens"],
        a["output_tokens"] + b["output_tokens"],
        a["input_tokens_details"]["cached_tokens"] + b["input_tokens_details"]["cached_tokens"],
        a["output_tokens_details"]["reasoning_tokens"] + b["output_tokens_details"]["reasoning_tokens"],
    )


def parse_usage(text: str) -> dict[str, Any] | None:
    return json.loads(text) if text else None


def render_turn(
    *,
    turn_id: str,
    session_id: str,
    agent_id: str,
    status: str,
    created_at: float,
    started_at: float | None,
    completed_at: float | None,
    error_code: str,
    error_message: str,
    usage_json: str,
    subagent_id: str | None = None,
) -> dict[str, Any]:
    """`Turn` (object: "agent.session.turn"); root turns have subagent_id null."""
    return {
        "id": turn_id,
        "object": "agent.session.turn",
        "session_id": session_id,
        "agent_id": agent_id,
        "status": status,
        "created_at": int(created_at),
        "started_at": int(started_at) if started_at is not None else None,
        "completed_at": int(completed_at) if completed_at is not None else None,
        "error": {"code": error_code, "message": error_message} if error_code else None,
        "subagent_id": subagent_id,
        "usage": parse_usage(usage_json),
    }


def environment_state(environment_id: str, status: str, error: tuple[str, str] | None = None) -> dict[str, Any]:
    """`AgentSessionEnvironmentState`."""
    return {
        "id": environment_id,
        "type": "openai_hosted",
        "status": status,
        "error": {"type": "sandbox_error", "code": error[0] or "setup_failed", "message": error[1]} if error else None,
    }


def without_secrets(session: session_pb2.Session) -> session_pb2.Session:
    """What an event may keep of a session: no MCP headers, environment
    variables, setup commands or inline file bytes (sizes stay)."""
    out = session_pb2.Session()
    out.CopyFrom(session)
    for tool in out.agent.config.tools:
        if tool.WhichOneof("tool") == "mcp" and tool.mcp.transport.WhichOneof("transport") == "http":
            tool.mcp.transport.http.ClearField("headers")
    config = out.environment.config
    config.ClearField("env")
    config.ClearField("setup_commands")
    for f in config.files:
        if f.WhichOneof("source") == "data":
            f.size_bytes = f.size_bytes or len(f.data)
            f.ClearField("data")
    return out


def session_event(event_type: str, session: session_pb2.Session) -> dict[str, Any]:
    """agent.session.{created,in_progress,idle,requires_action,failed}, as
    stored: the typed session in the converter's JSON (``SessionStatusEvent``)."""
    return {"type": event_type, "session": to_wire(without_secrets(session))}


def turn_event(event_type: str, turn: dict[str, Any], *, with_usage: bool = False) -> dict[str, Any]:
    """agent.session.turn.{created,in_progress,completed,failed,cancelled}."""
    event: dict[str, Any] = {"type": event_type, "session_id": turn["session_id"], "turn_id": turn["id"], "turn": turn}
    if with_usage:
        event["usage"] = turn["usage"]
    return event


def environment_event(
    event_type: str, session_id: str, turn_id: str | None, state: dict[str, Any]
) -> dict[str, Any]:
    """agent.session.environment.{pending,ready,failed}."""
    return {"type": event_type, "session_id": session_id, "turn_id": turn_id, "environment": state}


def error_event(session_id: str, error_type: str, code: str, message: str) -> dict[str, Any]:
    """The `error` event."""
    return {
        "type": "error",
        "session_id": session_id,
        "error": {"type": error_type, "code": code, "message": message, "param": None},
    }


# Session status events written before the typed contract stored the
# public AgentSession JSON, which the converter cannot read back.
_STATUS_MEMBERS = {
    "agent.session.created": "session_created",
    "agent.session.in_progress": "session_in_progress",
    "agent.session.idle": "session_idle",
    "agent.session.requires_action": "session_requires_action",
    "agent.session.failed": "session_failed",
}


def legacy_status_event(sequence: int, event_json: str, now: session_pb2.Session) -> session_pb2.SessionEvent | None:
    """A pre-contract session status event, served with the session as it is
    ``now`` at the status the event announced; None if it is not one."""
    stored = json.loads(event_json)
    member = _STATUS_MEMBERS.get(stored.get("type", ""))
    legacy = stored.get("session")
    if member is None or not isinstance(legacy, dict) or legacy.get("object") != "agent.session":
        return None
    event = session_pb2.SessionEvent(sequence=sequence, type=stored["type"], event_id=str(stored.get("event_id", "")))
    session = getattr(event, member).session
    session.CopyFrom(without_secrets(now))
    status = legacy.get("status")
    if isinstance(status, str) and status in SessionStatus._value2member_map_:
        session.status = session_status_to_proto(status)
    return event
