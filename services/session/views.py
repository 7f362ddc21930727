"""Rendering stored rows as wire objects (sessions and turns, as events carry them)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from berth.environment.v1 import environment_pb2
from services.session import repository as repo
from services.session import wire
from services.session.agents import AgentConfig, render_session_agent
from services.session.models import SessionRow, TurnRow
from services.session.states import SessionStatus

__all__ = [
    "SessionView",
    "session_view",
    "snapshot",
    "agent_config_from_json",
    "turn_json",
    "effective_status",
    "message_text",
]


@dataclass
class SessionView:
    row: SessionRow
    status: str
    error: str
    agent: dict[str, Any]
    environment: environment_pb2.Environment | None
    required_actions: list[dict[str, Any]]
    wire: dict[str, Any]


def snapshot(row: SessionRow) -> dict[str, Any]:
    """The stored snapshot: {"id", "name", "config"}."""
    data: dict[str, Any] = json.loads(row.agent_config_json)
    return data


def agent_config_from_json(agent_config_json: str) -> AgentConfig:
    """The agent config of a stored snapshot (``sessions.agent_config_json``)."""
    config: AgentConfig = json.loads(agent_config_json)["config"]
    return config


def effective_status(row: SessionRow, env: environment_pb2.Environment | None) -> tuple[str, str]:
    """A failed environment setup is reported on the session, whatever it is doing."""
    if env is not None and env.status == environment_pb2.ENVIRONMENT_STATUS_FAILED:
        message = env.error.message or row.error or "environment setup failed"
        return SessionStatus.FAILED, message
    return row.status, row.error


async def session_view(
    s: AsyncSession,
    row: SessionRow,
    env: environment_pb2.Environment | None,
    *,
    status: str | None = None,
    actions: list[dict[str, Any]] | None = None,
) -> SessionView:
    """``status`` forces the status (events carry the status they announce);
    otherwise a failed environment makes the session failed. ``actions`` are
    the session's required actions when the caller knows them (no turn is
    waiting: none); otherwise they are read."""
    snap = snapshot(row)
    agent = render_session_agent(snap["id"], snap.get("name"), snap["config"])
    if actions is None:
        actions = await repo.required_actions(s, row.id)
    if status is None:
        shown_status, error = effective_status(row, env)
    else:
        shown_status, error = status, row.error
    body = wire.render_session(
        session_id=row.id,
        agent_json=agent,
        created_at=row.created_at,
        last_active_at=row.last_active_at,
        environment=wire.render_environment(row.environment_kind, row.environment_id, env),
        status=shown_status,
        error=error,
        metadata=json.loads(row.metadata_json),
        required_actions=actions,
        usage_json=row.usage_json,
        vault_ids=json.loads(row.vault_ids_json),
    )
    return SessionView(row, shown_status, error, agent, env, actions, body)


def message_text(parts: list[dict[str, Any]]) -> str:
    """A user message as the model reads it."""
    return "\n".join(p["text"] if p["type"] == "input_text" else f"[image: {p['image_url']}]" for p in parts)


def turn_json(row: TurnRow) -> dict[str, Any]:
    return wire.render_turn(
        turn_id=row.id,
        session_id=row.session_id,
        agent_id=row.agent_id,
        status=row.status,
        created_at=row.created_at,
        started_at=row.started_at,
        completed_at=row.completed_at,
        error_code=row.error_code,
        error_message=row.error_message,
        usage_json=row.usage_json,
    )

