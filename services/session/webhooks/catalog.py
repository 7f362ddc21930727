"""The webhook event types and how the session event log maps onto them.

Names follow the OpenAI webhook events (``openai/types/webhooks``) where
one exists (``agent.session.*``, ``agent.environment.*``) and the same style
for Berth's own (turns, artifacts, automation invocations). A payload is the
OpenAI envelope ``{id, object: "event", created_at, type, data}``; the
SDK-named types carry the SDK's ``data`` shapes, so
``client.webhooks.unwrap`` parses them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

__all__ = [
    "EVENT_TYPES",
    "AUTOMATION_EVENT_TYPES",
    "SESSION_EVENT_TYPES",
    "WebhookEvent",
    "SessionFacts",
    "envelope",
    "from_session_event",
    "artifact_created",
]

AUTOMATION_EVENT_TYPES: tuple[str, ...] = (
    "agent.automation.invocation.queued",
    "agent.automation.invocation.completed",
    "agent.automation.invocation.failed",
    "agent.automation.invocation.skipped",
)

# Session log event type -> webhook event type.
_SESSION_STATUS = {
    "agent.session.created": "agent.session.created",
    "agent.session.in_progress": "agent.session.in_progress",
    "agent.session.idle": "agent.session.idle",
    "agent.session.requires_action": "agent.session.action_required",
    "agent.session.failed": "agent.session.failed",
}
_TURN_END = {
    "agent.session.turn.completed": "agent.session.turn.completed",
    "agent.session.turn.failed": "agent.session.turn.failed",
    "agent.session.turn.cancelled": "agent.session.turn.cancelled",
}
_ENVIRONMENT = {
    "agent.session.environment.ready": "agent.environment.ready",
    "agent.session.environment.failed": "agent.environment.failed",
}
# The log event types that announce a webhook event: the hot path checks this set alone.
SESSION_EVENT_TYPES = frozenset(_SESSION_STATUS) | frozenset(_TURN_END) | frozenset(_ENVIRONMENT)

ARTIFACT_CREATED = "agent.session.artifact.created"

EVENT_TYPES: tuple[str, ...] = (
    *_SESSION_STATUS.values(),
    *_TURN_END.values(),
    *_ENVIRONMENT.values(),
    ARTIFACT_CREATED,
    *AUTOMATION_EVENT_TYPES,
)


@dataclass(frozen=True)
class WebhookEvent:
    """One event to announce: its ID (the ``webhook-id`` of every attempt),
    type and ``data``."""

    id: str
    type: str
    data: dict[str, Any]


def envelope(event: WebhookEvent, created_at: float | None = None) -> dict[str, Any]:
    return {
        "id": event.id,
        "object": "event",
        "created_at": int(created_at if created_at is not None else time.time()),
        "type": event.type,
        "data": event.data,
    }


@dataclass(frozen=True)
class SessionFacts:
    """What a session event's webhook needs of its session row."""

    session_id: str
    environment_kind: str
    environment_id: str


def from_session_event(event: dict[str, Any], session: SessionFacts) -> WebhookEvent | None:
    """The webhook event a session log event announces, or None."""
    kind = str(event.get("type", ""))
    event_id = str(event["event_id"])
    if kind in _SESSION_STATUS:
        hosted = session.environment_kind == "hosted"
        data = {
            "id": session.session_id,
            "environment_type": "openai_hosted" if hosted else "none",
            "environment_id": session.environment_id if hosted and session.environment_id else None,
        }
        return WebhookEvent(event_id, _SESSION_STATUS[kind], data)
    if kind in _TURN_END:
        turn = event.get("turn") or {}
        data = {"id": str(event.get("turn_id") or turn.get("id", "")), "session_id": session.session_id}
        error = turn.get("error") if isinstance(turn, dict) else None
        if error:
            data["error"] = error
        return WebhookEvent(event_id, _TURN_END[kind], data)
    if kind in _ENVIRONMENT and session.environment_id:
        return WebhookEvent(event_id, _ENVIRONMENT[kind], {"id": session.environment_id, "session_id": session.session_id})
    return None


def artifact_created(event_id: str, *, artifact_id: str, session_id: str, turn_id: str, path: str, size_bytes: int) -> WebhookEvent:
    return WebhookEvent(
        event_id,
        ARTIFACT_CREATED,
        {"id": artifact_id, "session_id": session_id, "turn_id": turn_id, "path": path, "size_bytes": size_bytes},
    )
