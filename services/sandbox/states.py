"""The states of sandboxes and MCP brokers, and their one mapping to the
proto enums.

Sandbox states are the strings stored in ``sandboxes.state``; broker states
are the daemon's (services/sandbox/daemon/sandboxd.py keeps its own copy of
its protocol strings). A member compares and serializes as its string.
Backends speak their own engine's vocabulary (Docker's container status),
not these.
"""

from __future__ import annotations

from enum import StrEnum

from berth.sandbox.v1 import sandbox_pb2

__all__ = [
    "SandboxState",
    "McpBrokerState",
    "LIVE_STATES",
    "sandbox_state_to_proto",
    "sandbox_state_from_proto",
    "mcp_broker_state_to_proto",
    "mcp_broker_state_from_proto",
]


class SandboxState(StrEnum):
    CREATING = "creating"
    RUNNING = "running"
    PAUSED = "paused"
    DESTROYED = "destroyed"
    ERROR = "error"


class McpBrokerState(StrEnum):
    RUNNING = "running"
    DEAD = "dead"


# States in which a sandbox holds the node's resources.
LIVE_STATES = (SandboxState.CREATING, SandboxState.RUNNING, SandboxState.PAUSED)

_SANDBOX_TO_PROTO: dict[SandboxState, sandbox_pb2.SandboxState.ValueType] = {
    SandboxState.CREATING: sandbox_pb2.SANDBOX_STATE_CREATING,
    SandboxState.RUNNING: sandbox_pb2.SANDBOX_STATE_RUNNING,
    SandboxState.PAUSED: sandbox_pb2.SANDBOX_STATE_PAUSED,
    SandboxState.DESTROYED: sandbox_pb2.SANDBOX_STATE_DESTROYED,
    SandboxState.ERROR: sandbox_pb2.SANDBOX_STATE_ERROR,
}
_SANDBOX_FROM_PROTO = {v: k for k, v in _SANDBOX_TO_PROTO.items()}

_BROKER_TO_PROTO: dict[McpBrokerState, sandbox_pb2.McpBrokerState.ValueType] = {
    McpBrokerState.RUNNING: sandbox_pb2.MCP_BROKER_STATE_RUNNING,
    McpBrokerState.DEAD: sandbox_pb2.MCP_BROKER_STATE_DEAD,
}
_BROKER_FROM_PROTO = {v: k for k, v in _BROKER_TO_PROTO.items()}


def sandbox_state_to_proto(state: str) -> sandbox_pb2.SandboxState.ValueType:
    """A stored state (a ``SandboxState`` value) as the proto enum; an
    unknown string is ``SANDBOX_STATE_UNSPECIFIED``."""
    try:
        return _SANDBOX_TO_PROTO[SandboxState(state)]
    except ValueError:
        return sandbox_pb2.SANDBOX_STATE_UNSPECIFIED


def sandbox_state_from_proto(state: sandbox_pb2.SandboxState.ValueType) -> SandboxState:
    """Raises ``KeyError`` for ``SANDBOX_STATE_UNSPECIFIED``."""
    return _SANDBOX_FROM_PROTO[state]


def mcp_broker_state_to_proto(state: str) -> sandbox_pb2.McpBrokerState.ValueType:
    """A broker state as the proto enum; an unknown string is
    ``MCP_BROKER_STATE_UNSPECIFIED``."""
    try:
        return _BROKER_TO_PROTO[McpBrokerState(state)]
    except ValueError:
        return sandbox_pb2.MCP_BROKER_STATE_UNSPECIFIED


def mcp_broker_state_from_proto(state: sandbox_pb2.McpBrokerState.ValueType) -> McpBrokerState:
    """Raises ``KeyError`` for ``MCP_BROKER_STATE_UNSPECIFIED``."""
    return _BROKER_FROM_PROTO[state]
