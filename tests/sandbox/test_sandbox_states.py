"""Sandbox and MCP broker states map to their proto enums in one place, totally."""

from __future__ import annotations

from berth.sandbox.v1 import sandbox_pb2
from services.sandbox.states import (
    McpBrokerState,
    SandboxState,
    mcp_broker_state_from_proto,
    mcp_broker_state_to_proto,
    sandbox_state_from_proto,
    sandbox_state_to_proto,
)


def test_every_sandbox_state_maps_to_a_proto_state_and_back() -> None:
    for state in SandboxState:
        assert sandbox_state_from_proto(sandbox_state_to_proto(state)) is state
    shown = {sandbox_state_to_proto(s) for s in SandboxState}
    assert shown == set(sandbox_pb2.SandboxState.values()) - {sandbox_pb2.SANDBOX_STATE_UNSPECIFIED}


def test_every_mcp_broker_state_maps_to_a_proto_state_and_back() -> None:
    for state in McpBrokerState:
        assert mcp_broker_state_from_proto(mcp_broker_state_to_proto(state)) is state
    shown = {mcp_broker_state_to_proto(s) for s in McpBrokerState}
    assert shown == set(sandbox_pb2.McpBrokerState.values()) - {sandbox_pb2.MCP_BROKER_STATE_UNSPECIFIED}


def test_stored_strings_are_the_state_values() -> None:
    assert sandbox_state_to_proto("paused") == sandbox_pb2.SANDBOX_STATE_PAUSED
    assert sandbox_state_to_proto("unknown") == sandbox_pb2.SANDBOX_STATE_UNSPECIFIED
    assert mcp_broker_state_to_proto("dead") == sandbox_pb2.MCP_BROKER_STATE_DEAD
