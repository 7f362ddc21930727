"""The states of environments, and their one mapping to the proto enum.

The values are the strings stored in ``environments.status``, so a member
compares and serializes as its string.
"""

from __future__ import annotations

from enum import StrEnum

from berth.environment.v1 import environment_pb2

__all__ = ["EnvironmentStatus", "SETTLED_STATUSES", "environment_status_to_proto", "environment_status_from_proto"]


class EnvironmentStatus(StrEnum):
    PENDING = "pending"
    INITIALIZING = "initializing"
    READY = "ready"
    FAILED = "failed"


# Setup has ended, one way or the other.
SETTLED_STATUSES = (EnvironmentStatus.READY, EnvironmentStatus.FAILED)

_TO_PROTO: dict[EnvironmentStatus, environment_pb2.EnvironmentStatus.ValueType] = {
    EnvironmentStatus.PENDING: environment_pb2.ENVIRONMENT_STATUS_PENDING,
    EnvironmentStatus.INITIALIZING: environment_pb2.ENVIRONMENT_STATUS_INITIALIZING,
    EnvironmentStatus.READY: environment_pb2.ENVIRONMENT_STATUS_READY,
    EnvironmentStatus.FAILED: environment_pb2.ENVIRONMENT_STATUS_FAILED,
}
_FROM_PROTO = {v: k for k, v in _TO_PROTO.items()}


def environment_status_to_proto(status: str) -> environment_pb2.EnvironmentStatus.ValueType:
    """A stored status (an ``EnvironmentStatus`` value) as the proto enum.
    Raises ``ValueError`` for a string that is no status."""
    return _TO_PROTO[EnvironmentStatus(status)]


def environment_status_from_proto(status: environment_pb2.EnvironmentStatus.ValueType) -> EnvironmentStatus:
    """Raises ``KeyError`` for ``ENVIRONMENT_STATUS_UNSPECIFIED``."""
    return _FROM_PROTO[status]
