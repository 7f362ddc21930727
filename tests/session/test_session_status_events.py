"""Session status events store the typed session, without its secrets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sqlalchemy import update
from session_support import Client

from berth.environment.v1 import environment_pb2
from berth.session.v1 import session_pb2
from gateway import render
from services.core.db import open_database
from services.core.settings import Settings
from services.core.wire_json import to_message
from services.session import wire
from services.session.models import EventRow


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


def test_a_pre_contract_status_event_is_read_with_the_current_session_at_its_announced_status() -> None:
    # Before the typed contract, a status event stored the public AgentSession JSON.
    stored = json.dumps(
        {
            "event_id": "evt_old",
            "type": "agent.session.requires_action",
            "session": {"id": "sess_1", "object": "agent.session", "status": "requires_action", "agent": {}},
        }
    )
    event = wire.legacy_status_event(7, stored, _session_with_secrets())
    assert event is not None
    assert (event.sequence, event.type, event.event_id) == (7, "agent.session.requires_action", "evt_old")
    kept = event.session_requires_action.session
    assert kept.id == "sess_1" and kept.status == session_pb2.SESSION_STATUS_REQUIRES_ACTION
    assert not kept.environment.config.env and not kept.agent.config.tools[0].mcp.transport.http.headers


def test_an_unreadable_event_that_is_not_a_pre_contract_status_event_is_not_guessed_at() -> None:
    unknown = json.dumps({"event_id": "evt_x", "type": "agent.session.turn.created", "turn": {"object": "nonsense"}})
    assert wire.legacy_status_event(1, unknown, _session_with_secrets()) is None
    typed_shape = json.dumps({"event_id": "evt_y", "type": "agent.session.idle", "session": {"id": "sess_1"}})
    assert wire.legacy_status_event(1, typed_shape, _session_with_secrets()) is None


async def test_a_session_whose_log_holds_a_pre_contract_status_event_still_streams(
    client: Client, settings: Settings
) -> None:
    created = await client.create_session({"agent": {"model": "scripted"}, "environment": {"type": "none"}})
    session_id = created.session.id
    legacy = {"event_id": "evt_old", "type": "agent.session.created", "session": {"id": session_id, "object": "agent.session", "status": "idle"}}
    migrations = Path(str(__import__("services.session.server", fromlist=["x"]).__file__)).parent / "migrations" / "versions"
    db = await open_database(settings.database_url("session"), "session", migrations)
    try:
        async with db.transaction() as s:
            await s.execute(
                update(EventRow)
                .where(EventRow.session_id == session_id, EventRow.type == "agent.session.created")
                .values(event_json=json.dumps(legacy))
            )
    finally:
        await db.dispose()
    events = await client.events(session_id)
    first = events[0][1]
    assert first["type"] == "agent.session.created" and first["event_id"] == "evt_old"
    assert first["session"]["id"] == session_id and first["session"]["status"] == "idle"
