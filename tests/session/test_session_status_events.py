"""Session status events store the typed session, without its secrets."""

from __future__ import annotations

from berth.environment.v1 import environment_pb2
from berth.session.v1 import session_pb2
from gateway import render
from services.core.wire_json import to_message
from services.session import wire


def _session_with_secrets() -> session_pb2.Session:
    session = session_pb2.Session(
        id="sess_1",
        status=session_pb2.SESSION_STATUS_IDLE,
        environment_kind=session_pb2.ENVIRONMENT_KIND_HOSTED,
        environment_id="env_1",
    )
    tool = session.agent.config.tools.add()
    tool.mcp.server_label = "docs"
    tool.mcp.transport.http.server_url = "https://mcp.example"
    tool.mcp.transport.http.headers["Authorization"] = "Bearer secret"
    env = session.environment
    env.id = "env_1"
    env.status = environment_pb2.ENVIRONMENT_STATUS_READY
    env.config.env["TOKEN"] = "secret"
    env.config.setup_commands.add(command="echo secret")
    env.config.files.add(path="/a.txt", data=b"secret bytes", id="file_1")
    return session


def test_a_stored_session_event_keeps_no_headers_env_vars_setup_commands_or_file_bytes() -> None:
    stored = wire.session_event("agent.session.created", _session_with_secrets())
    event = to_message(stored, session_pb2.SessionEvent(sequence=1))
    kept = event.session_created.session
    assert kept.id == "sess_1" and kept.environment.id == "env_1"
    assert not kept.agent.config.tools[0].mcp.transport.http.headers
    assert kept.agent.config.tools[0].mcp.transport.http.server_url == "https://mcp.example"
    assert not kept.environment.config.env and not kept.environment.config.setup_commands
    (kept_file,) = kept.environment.config.files
    assert kept_file.WhichOneof("source") is None and kept_file.size_bytes == len(b"secret bytes")
    assert "secret" not in str(stored)


def test_a_stored_session_event_renders_as_the_public_session() -> None:
    session = _session_with_secrets()
    event = to_message(wire.session_event("agent.session.idle", session), session_pb2.SessionEvent(sequence=3))
    public = render.event(event)
    assert public["type"] == "agent.session.idle"
    assert public["session"] == render.session(session)
