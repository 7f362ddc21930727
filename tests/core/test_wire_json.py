"""The one mapping between contract messages and public wire JSON: what the
Session service stores comes back out unchanged, and anything the contract
does not know is refused rather than dropped."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from berth.session.v1 import session_pb2, session_service_pb2
from services.core.wire_json import to_message, to_wire

TURN: dict[str, Any] = {
    "object": "agent.session.turn",
    "id": "turn_1",
    "session_id": "sess_1",
    "agent_id": "agent_1",
    "status": "failed",
    "created_at": 1_700_000_000,
    "started_at": 1_700_000_001,
    "completed_at": 1_700_000_002,
    "error": {"code": "model_error", "message": "boom"},
    "subagent_id": None,
    "usage": {
        "input_tokens": 3,
        "input_tokens_details": {"cached_tokens": 1},
        "output_tokens": 2,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 5,
    },
}

ITEMS: list[dict[str, Any]] = [
    {
        "id": "item_1",
        "type": "message",
        "role": "user",
        "status": "completed",
        "phase": None,
        "content": [{"type": "input_text", "text": "hi"}, {"type": "input_image", "image_url": "https://x/y.png"}],
        "turn_id": "turn_1",
    },
    {"id": "item_2", "type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}", "status": "in_progress", "turn_id": "turn_1"},
    {"id": "item_3", "type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text", "text": "x"}], "error": None, "status": "completed", "turn_id": "turn_1"},
    {"id": "item_4", "type": "command_execution", "command": "ls", "cwd": "/workspace", "status": "completed", "exit_code": 0, "output": "a\n", "duration_ms": 12, "turn_id": "turn_1"},
    {"id": "item_5", "type": "mcp_call", "server_label": "s", "name": "t", "arguments": {"n": 1, "f": 1.5}, "output": {"content": [{"type": "text", "text": "ok"}]}, "error": None, "status": "completed", "turn_id": "turn_1"},
    {"id": "item_6", "type": "mcp_call", "server_label": "s", "name": "t", "arguments": "not json", "output": None, "error": "bad arguments", "status": "failed", "turn_id": "turn_1"},
]

# A session event stores the typed session in the converter's JSON.
SESSION = to_wire(
    session_pb2.Session(
        id="sess_1", status=session_pb2.SESSION_STATUS_IDLE, create_time=Timestamp(seconds=1_700_000_000), vault_ids=["vlt_1"]
    )
)
EVENTS: list[dict[str, Any]] = [
    {"event_id": "evt_1", "type": "agent.session.created", "session": SESSION},
    {"event_id": "evt_2", "type": "agent.session.turn.created", "session_id": "sess_1", "turn_id": "turn_1", "turn": TURN},
    {"event_id": "evt_3", "type": "agent.session.turn.failed", "session_id": "sess_1", "turn_id": "turn_1", "turn": TURN, "usage": TURN["usage"]},
    {"event_id": "evt_4", "type": "agent.session.turn.item.added", "session_id": "sess_1", "turn_id": "turn_1", "item": ITEMS[3], "output_index": 0},
    {"event_id": "evt_5", "type": "agent.session.turn.item.done", "session_id": "sess_1", "turn_id": "turn_1", "item": ITEMS[4], "output_index": 1},
    {"event_id": "evt_6", "type": "agent.session.turn.content_part.added", "session_id": "sess_1", "turn_id": "turn_1", "item_id": "item_7", "output_index": 2, "content_index": 0, "part": {"type": "output_text", "text": ""}},
    {"event_id": "evt_7", "type": "agent.session.turn.output_text.delta", "session_id": "sess_1", "turn_id": "turn_1", "item_id": "item_7", "output_index": 2, "content_index": 0, "delta": "hi"},
    {"event_id": "evt_8", "type": "agent.output.command_execution_output.delta", "session_id": "sess_1", "turn_id": "turn_1", "item_id": "item_4", "output_index": 0, "delta": "a\n"},
    {"event_id": "evt_9", "type": "agent.session.environment.failed", "session_id": "sess_1", "turn_id": None, "environment": {"id": "env_1", "type": "openai_hosted", "status": "failed", "error": {"type": "sandbox_error", "code": "setup_failed", "message": "no"}}},
    {"event_id": "evt_10", "type": "error", "session_id": "sess_1", "error": {"type": "model_error", "code": "model_error", "message": "boom", "param": None}},
]


def test_a_stored_turn_renders_back_to_the_same_json() -> None:
    turn = to_message(TURN, session_pb2.Turn())
    assert turn.status == session_pb2.TURN_STATUS_FAILED and turn.usage.total_tokens == 5
    assert to_wire(turn) == TURN


@pytest.mark.parametrize("item", ITEMS, ids=[i["id"] for i in ITEMS])
def test_every_stored_item_type_renders_back_to_the_same_json(item: dict[str, Any]) -> None:
    message = to_message(item, session_pb2.Item(session_id="sess_1"))
    assert message.WhichOneof("item") == item["type"]
    assert to_wire(message) == item  # session_id is contract-only


@pytest.mark.parametrize("event", EVENTS, ids=[e["type"] for e in EVENTS])
def test_every_stored_event_type_renders_back_to_the_same_json(event: dict[str, Any]) -> None:
    message = to_message(event, session_pb2.SessionEvent(sequence=7))
    assert message.WhichOneof("payload") is not None and message.type == event["type"]
    assert to_wire(message) == event  # sequence is the SSE id, not part of the object


def test_input_events_leave_out_what_the_client_did_not_send() -> None:
    sent = {"type": "agent.session.input.tool_result", "turn_id": "turn_1", "call_id": "call_1", "success": False, "error": "no"}
    message = to_message(sent, session_service_pb2.InputEvent())
    assert message.WhichOneof("payload") == "tool_result"
    assert to_wire(message, nulls=False) == sent
    assert to_wire(message)["output"] is None


@pytest.mark.parametrize(
    ("data", "target"),
    [
        ({**TURN, "surprise": 1}, session_pb2.Turn()),
        ({**TURN, "status": "sleeping"}, session_pb2.Turn()),
        ({**ITEMS[0], "type": "hologram"}, session_pb2.Item()),
        ({**ITEMS[3], "exit_status": 0}, session_pb2.Item()),
        ({"event_id": "evt_1", "type": "agent.session.teleported"}, session_pb2.SessionEvent()),
    ],
)
def test_json_the_contract_does_not_know_is_refused(data: dict[str, Any], target: Any) -> None:
    with pytest.raises(ValueError):
        to_message(data, target)
