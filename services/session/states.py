"""The states of sessions and turns, and the session status's mapping to
the proto enum.

The values are the strings stored in the ``status`` columns (and shown in the
public API), so a member compares and serializes as its string. A turn's
status reaches the contract through the stored turn JSON: the converter
(services/core/wire_json.py) maps it by enum value name (``"queued"`` ->
``TURN_STATUS_QUEUED``), so it has no table here.
"""

from __future__ import annotations

from enum import StrEnum

from berth.session.v1 import automation_pb2, session_pb2

__all__ = [
    "SessionStatus",
    "TurnStatus",
    "ACTIVE_TURN_STATUSES",
    "RUNNING_TURN_STATUSES",
    "session_status_to_proto",
    "session_status_from_proto",
    "AutomationKind",
    "AutomationStatus",
    "InvocationStatus",
    "AUTOMATION_KIND_TO_PROTO",
    "AUTOMATION_KIND_FROM_PROTO",
    "AUTOMATION_STATUS_TO_PROTO",
    "INVOCATION_STATUS_TO_PROTO",
]


class SessionStatus(StrEnum):
    IDLE = "idle"
    IN_PROGRESS = "in_progress"
    REQUIRES_ACTION = "requires_action"
    FAILED = "failed"
    # Paused at the spend_control limit until it is raised or removed.
    BUDGET_REACHED = "budget_reached"
    # Internal: DeleteSession is tearing the session down. Such a session is
    # never listed or shown, and has no public status.
    DELETING = "deleting"


class TurnStatus(StrEnum):
    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    WAITING = "waiting"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


# A turn that has not ended.
ACTIVE_TURN_STATUSES = (TurnStatus.QUEUED, TurnStatus.IN_PROGRESS, TurnStatus.WAITING)
# A turn a worker has started and not ended: it holds a lease.
RUNNING_TURN_STATUSES = (TurnStatus.IN_PROGRESS, TurnStatus.WAITING)

_SESSION_TO_PROTO: dict[SessionStatus, session_pb2.SessionStatus.ValueType] = {
    SessionStatus.IDLE: session_pb2.SESSION_STATUS_IDLE,
    SessionStatus.IN_PROGRESS: session_pb2.SESSION_STATUS_IN_PROGRESS,
    SessionStatus.REQUIRES_ACTION: session_pb2.SESSION_STATUS_REQUIRES_ACTION,
    SessionStatus.FAILED: session_pb2.SESSION_STATUS_FAILED,
    SessionStatus.BUDGET_REACHED: session_pb2.SESSION_STATUS_BUDGET_REACHED,
    SessionStatus.DELETING: session_pb2.SESSION_STATUS_UNSPECIFIED,
}
_SESSION_FROM_PROTO = {v: k for k, v in _SESSION_TO_PROTO.items() if v != session_pb2.SESSION_STATUS_UNSPECIFIED}

def session_status_to_proto(status: str) -> session_pb2.SessionStatus.ValueType:
    """A stored or shown status (a ``SessionStatus`` value) as the proto
    enum; an unknown string is ``SESSION_STATUS_UNSPECIFIED``."""
    try:
        return _SESSION_TO_PROTO[SessionStatus(status)]
    except ValueError:
        return session_pb2.SESSION_STATUS_UNSPECIFIED


def session_status_from_proto(status: session_pb2.SessionStatus.ValueType) -> SessionStatus:
    """Raises ``KeyError`` for ``SESSION_STATUS_UNSPECIFIED``."""
    return _SESSION_FROM_PROTO[status]


class AutomationKind(StrEnum):
    PERIODIC = "periodic"
    ONCE = "once"


class AutomationStatus(StrEnum):
    ACTIVE = "active"
    PAUSED = "paused"
    # A one-time automation whose occurrence fired.
    COMPLETED = "completed"


class InvocationStatus(StrEnum):
    QUEUED = "queued"
    COMPLETED = "completed"
    FAILED = "failed"
    SKIPPED = "skipped"


AUTOMATION_KIND_TO_PROTO: dict[AutomationKind, automation_pb2.AutomationKind.ValueType] = {
    AutomationKind.PERIODIC: automation_pb2.AUTOMATION_KIND_PERIODIC,
    AutomationKind.ONCE: automation_pb2.AUTOMATION_KIND_ONCE,
}
AUTOMATION_KIND_FROM_PROTO = {v: k for k, v in AUTOMATION_KIND_TO_PROTO.items()}
AUTOMATION_STATUS_TO_PROTO: dict[AutomationStatus, automation_pb2.AutomationStatus.ValueType] = {
    AutomationStatus.ACTIVE: automation_pb2.AUTOMATION_STATUS_ACTIVE,
    AutomationStatus.PAUSED: automation_pb2.AUTOMATION_STATUS_PAUSED,
    AutomationStatus.COMPLETED: automation_pb2.AUTOMATION_STATUS_COMPLETED,
}
INVOCATION_STATUS_TO_PROTO: dict[InvocationStatus, automation_pb2.InvocationStatus.ValueType] = {
    InvocationStatus.QUEUED: automation_pb2.INVOCATION_STATUS_QUEUED,
    InvocationStatus.COMPLETED: automation_pb2.INVOCATION_STATUS_COMPLETED,
    InvocationStatus.FAILED: automation_pb2.INVOCATION_STATUS_FAILED,
    InvocationStatus.SKIPPED: automation_pb2.INVOCATION_STATUS_SKIPPED,
}
