"""Agents API wire JSON built by the Session service.

Every function returns a plain dict in the exact shape of the official SDK
model named in its docstring, with every required field present.
"""

from __future__ import annotations

import json
from typing import Any

from berth.common.v1 import common_pb2
from berth.environment.v1 import environment_pb2

__all__ = [
    "usage",
    "add_usage",
    "parse_usage",
    "render_turn",
    "render_environment",
    "environment_state",
    "render_session",
    "session_event",
    "turn_event",
    "environment_event",
    "error_event",
    "ENV_STATUS",
]

ENV_STATUS = {
    environment_pb2.ENVIRONMENT_STATUS_PENDING: "pending",
    environment_pb2.ENVIRONMENT_STATUS_INITIALIZING: "pending",
    environment_pb2.ENVIRONMENT_STATUS_READY: "ready",
    environment_pb2.ENVIRONMENT_STATUS_FAILED: "failed",
}

_NETWORK_ACCESS = {
    common_pb2.NETWORK_ACCESS_ENABLED: "enabled",
    common_pb2.NETWORK_ACCESS_DISABLED: "disabled",
    common_pb2.NETWORK_ACCESS_RESTRICTED: "restricted",
}

_LIFETIME = {environment_pb2.LIFETIME_PRIVATE: "private", environment_pb2.LIFETIME_SHARED: "shared"}


def usage(input_tokens: int = 0, output_tokens: int = 0, cached_tokens: int = 0, reasoning_tokens: int = 0) -> dict[str, Any]:
    """`TokenUsage`."""
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }


def add_usage(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    if a is None:
        return b
    if b is None:
        return a
    return usage(
        a["input_tokens"] + b["input_tokens"],
        a["output_tokens"] + b["output_tokens"],
        a["input_tokens_details"]["cached_tokens"] + b["input_tokens_details"]["cached_tokens"],
        a["output_tokens_details"]["reasoning_tokens"] + b["output_tokens_details"]["reasoning_tokens"],
    )


def parse_usage(text: str) -> dict[str, Any] | None:
    return json.loads(text) if text else None


def render_turn(
    *,
    turn_id: str,
    session_id: str,
    agent_id: str,
    status: str,
    created_at: float,
    started_at: float | None,
    completed_at: float | None,
    error_code: str,
    error_message: str,
    usage_json: str,
) -> dict[str, Any]:
    """`Turn` (object: "agent.session.turn"); root turns have subagent_id null."""
    return {
        "id": turn_id,
        "object": "agent.session.turn",
        "session_id": session_id,
        "agent_id": agent_id,
        "status": status,
        "created_at": int(created_at),
        "started_at": int(started_at) if started_at is not None else None,
        "completed_at": int(completed_at) if completed_at is not None else None,
        "error": {"code": error_code, "message": error_message} if error_code else None,
        "subagent_id": None,
        "usage": parse_usage(usage_json),
    }


def _files(config: environment_pb2.EnvironmentConfig) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for f in config.files:
        size = f.size_bytes or len(f.data)
        if f.WhichOneof("source") == "file_id":
            out.append({"type": "file_id", "id": f.id, "file_id": f.file_id, "path": f.path, "size_bytes": size})
        else:
            out.append({"type": "inline", "id": f.id, "path": f.path, "size_bytes": size})
    return out


def _capabilities(raw: str, kind: str) -> list[dict[str, Any]]:
    try:
        entries = json.loads(raw) if raw else []
    except ValueError:
        return []
    out: list[dict[str, Any]] = []
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, dict):
            continue
        if kind == "skills" and entry.get("type") == "skill_reference":
            skill_id = str(entry.get("skill_id", ""))
            out.append(
                {
                    "type": "skill_reference",
                    "skill_id": skill_id,
                    "name": str(entry.get("name") or skill_id),
                    "description": str(entry.get("description") or ""),
                    "version": str(entry.get("version") or "latest"),
                }
            )
        else:
            out.append({"type": "inline", "name": str(entry.get("name", "")), "description": str(entry.get("description", ""))})
    return out


def render_environment(kind: str, environment_id: str, env: environment_pb2.Environment | None) -> dict[str, Any]:
    """`AgentSession.environment`: {"type":"none"} or the openai_hosted shape,
    plus the additive fields the gateway renders too (status, lifetime,
    session_count, error, created_at, network.blocked_domains)."""
    if kind == "none":
        return {"type": "none"}
    if env is None or not env.id:
        env = environment_pb2.Environment(id=environment_id)
    config = env.config
    network = config.network
    error = {"code": env.error.code, "message": env.error.message} if env.error.code or env.error.message else None
    return {
        "type": "openai_hosted",
        "id": env.id,
        "files": _files(config),
        "skills": _capabilities(config.skills_json, "skills"),
        "plugins": _capabilities(config.plugins_json, "plugins"),
        "status": ENV_STATUS.get(env.status, "pending"),
        "capability_directories": list(config.capability_directories),
        "network": {
            "access": _NETWORK_ACCESS.get(network.access, "enabled"),
            "allowed_domains": list(network.allowed_domains),
            "blocked_domains": list(network.blocked_domains),
        },
        "packages": {
            "npm": list(config.packages.npm),
            "python": list(config.packages.python),
            "system": list(config.packages.system),
        },
        "container_size": config.container_size if config.container_size in ("small", "medium", "large") else None,
        "lifetime": _LIFETIME.get(env.lifetime, "private"),
        "session_count": env.session_count,
        "error": error,
        "created_at": int(env.create_time.seconds),
    }


def environment_state(environment_id: str, status: str, error: tuple[str, str] | None = None) -> dict[str, Any]:
    """`AgentSessionEnvironmentState`."""
    return {
        "id": environment_id,
        "type": "openai_hosted",
        "status": status,
        "error": {"type": "sandbox_error", "code": error[0] or "setup_failed", "message": error[1]} if error else None,
    }


def render_session(
    *,
    session_id: str,
    agent_json: dict[str, Any],
    created_at: float,
    last_active_at: float,
    environment: dict[str, Any],
    status: str,
    error: str,
    metadata: dict[str, str],
    required_actions: list[dict[str, Any]],
    usage_json: str,
    vault_ids: list[str],
) -> dict[str, Any]:
    """`AgentSession` (object: "agent.session")."""
    return {
        "id": session_id,
        "object": "agent.session",
        "agent": agent_json,
        "created_at": int(created_at),
        "last_active_at": int(last_active_at),
        "environment": environment,
        "error": error or None,
        "metadata": dict(metadata),
        "required_actions": required_actions,
        "status": status,
        "usage": parse_usage(usage_json),
        "vault_ids": list(vault_ids),
    }


def session_event(event_type: str, session: dict[str, Any]) -> dict[str, Any]:
    """agent.session.{created,in_progress,idle,requires_action,failed}."""
    return {"type": event_type, "session": session}


def turn_event(event_type: str, turn: dict[str, Any], *, with_usage: bool = False) -> dict[str, Any]:
    """agent.session.turn.{created,in_progress,completed,failed,cancelled}."""
    event: dict[str, Any] = {"type": event_type, "session_id": turn["session_id"], "turn_id": turn["id"], "turn": turn}
    if with_usage:
        event["usage"] = turn["usage"]
    return event


def environment_event(
    event_type: str, session_id: str, turn_id: str | None, state: dict[str, Any]
) -> dict[str, Any]:
    """agent.session.environment.{pending,ready,failed}."""
    return {"type": event_type, "session_id": session_id, "turn_id": turn_id, "environment": state}


def error_event(session_id: str, error_type: str, code: str, message: str) -> dict[str, Any]:
    """The `error` event."""
    return {
        "type": "error",
        "session_id": session_id,
        "error": {"type": error_type, "code": code, "message": message, "param": None},
    }
