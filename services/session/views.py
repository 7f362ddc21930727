"""Stored session rows as contract messages (``Session`` as responses and
session events carry it; turns as events carry them). The gateway renders
them as public JSON."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp
from sqlalchemy.ext.asyncio import AsyncSession

from berth.environment.v1 import environment_pb2
from berth.session.v1 import session_pb2
from services.core.wire_json import to_message
from services.session.session_controls import PriceTable, SessionControls, consumed_cents
from services.session import repository as repo
from services.session import wire
from services.session.agents import AgentConfig, config_message
from services.session.models import SessionRow, TurnRow
from services.session.states import SessionStatus, session_status_to_proto

__all__ = [
    "SessionView",
    "session_view",
    "snapshot",
    "agent_config_from_json",
    "timestamp",
    "turn_json",
    "effective_status",
    "message_text",
]


def timestamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1_000_000_000))
    return stamp


@dataclass
class SessionView:
    row: SessionRow
    status: str
    error: str
    environment: environment_pb2.Environment | None
    required_actions: list[dict[str, Any]]
    # spend_control.consumed; None when unavailable.
    consumed_cents: int | None = None

    @cached_property
    def message(self) -> session_pb2.Session:
        """The ``Session`` contract message, with the shown status and error."""
        row = self.row
        message = session_pb2.Session(
            id=row.id,
            org_id=row.org_id,
            agent_id=row.agent_id,
            environment_kind=(
                session_pb2.ENVIRONMENT_KIND_HOSTED
                if row.environment_kind == "hosted"
                else session_pb2.ENVIRONMENT_KIND_NONE
            ),
            environment_id=row.environment_id,
            status=session_status_to_proto(self.status),
            error=self.error,
            metadata=json.loads(row.metadata_json),
            vault_ids=json.loads(row.vault_ids_json),
            create_time=timestamp(row.created_at),
            last_active_time=timestamp(row.last_active_at),
            last_sequence=row.event_seq,
        )
        for action in self.required_actions:
            to_message(action, message.required_actions.add())
        if row.usage_json:
            to_message(json.loads(row.usage_json), message.usage)
        if row.controls_json:
            message.controls.CopyFrom(SessionControls.from_json(row.controls_json).to_proto())
        if self.consumed_cents is not None:
            message.spend_consumed_cents = self.consumed_cents
        snap = snapshot(row)
        message.agent.id = snap["id"]
        if snap.get("name") is not None:
            message.agent.name = snap["name"]
        message.agent.config.CopyFrom(config_message(snap["config"]))
        if self.environment is not None:
            message.environment.CopyFrom(self.environment)
        return message


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
    prices: PriceTable,
    status: str | None = None,
    actions: list[dict[str, Any]] | None = None,
) -> SessionView:
    """``status`` forces the status (events carry the status they announce);
    otherwise a failed environment makes the session failed. ``actions`` are
    the session's required actions when the caller knows them (no turn is
    waiting: none); otherwise they are read. ``prices`` price its spend."""
    if actions is None:
        actions = await repo.required_actions(s, row.id)
    if status is None:
        shown_status, error = effective_status(row, env)
    else:
        shown_status, error = status, row.error
    return SessionView(row, shown_status, error, env, actions, await consumed_cents(s, row, prices))


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
        subagent_id=row.subagent_id,
    )

