"""Environment states map to their proto enum in one place, totally."""

from __future__ import annotations

from berth.environment.v1 import environment_pb2
from services.environment.states import EnvironmentStatus, environment_status_from_proto, environment_status_to_proto


def test_every_environment_status_maps_to_a_proto_status_and_back() -> None:
    for status in EnvironmentStatus:
        assert environment_status_from_proto(environment_status_to_proto(status)) is status
    shown = {environment_status_to_proto(s) for s in EnvironmentStatus}
    assert shown == set(environment_pb2.EnvironmentStatus.values()) - {environment_pb2.ENVIRONMENT_STATUS_UNSPECIFIED}


def test_stored_strings_are_the_status_values() -> None:
    assert environment_status_to_proto("initializing") == environment_pb2.ENVIRONMENT_STATUS_INITIALIZING
