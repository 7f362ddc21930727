"""Session and turn states map to their proto enums in one place each, totally."""

from __future__ import annotations

from berth.session.v1 import session_pb2
from services.session.states import (
    SessionStatus,
    TurnStatus,
    session_status_from_proto,
    session_status_to_proto,
)
from services.core.wire_json import to_message, to_wire


def test_every_public_session_status_maps_to_a_proto_status_and_back() -> None:
    public = [s for s in SessionStatus if s is not SessionStatus.DELETING]
    for status in public:
        assert session_status_from_proto(session_status_to_proto(status)) is status
    shown = {session_status_to_proto(s) for s in public}
    assert shown == set(session_pb2.SessionStatus.values()) - {session_pb2.SESSION_STATUS_UNSPECIFIED}


def test_a_deleting_session_has_no_public_status() -> None:
    assert session_status_to_proto(SessionStatus.DELETING) == session_pb2.SESSION_STATUS_UNSPECIFIED


def test_every_turn_status_maps_to_a_proto_status_and_back_through_the_converter() -> None:
    shown = set()
    for status in TurnStatus:
        message = to_message({"status": status.value}, session_pb2.Turn())
        assert message.status != session_pb2.TURN_STATUS_UNSPECIFIED
        assert to_wire(message)["status"] == status
        shown.add(message.status)
    assert shown == set(session_pb2.TurnStatus.values()) - {session_pb2.TURN_STATUS_UNSPECIFIED}


def test_stored_strings_are_the_status_values() -> None:
    assert to_message({"status": "waiting"}, session_pb2.Turn()).status == session_pb2.TURN_STATUS_WAITING
    assert session_status_to_proto("requires_action") == session_pb2.SESSION_STATUS_REQUIRES_ACTION
