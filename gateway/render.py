"""Contract messages -> Agents API wire JSON.

Shapes follow the SDK models field by field (docs/wire-contract.md); every
required field is present. Berth-only fields (``lifetime``,
``session_count``, ``error``...) are additive. Setup command bodies and
inline file or archive bytes are never rendered.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, TypeVar

from google.protobuf.timestamp_pb2 import Timestamp

from berth.common.v1 import common_pb2
from berth.environment.v1 import environment_pb2, vault_pb2
from berth.session.v1 import session_pb2
from services.core.agent_tools import tool_json
from services.core.wire_json import to_wire
from services.core.structs import from_struct

__all__ = [
    "seconds",
    "environment_status",
    "environment_info",
    "hosted_environment",
    "environment_template",
    "environment_file",
    "registered_file",
    "stored_file",
    "agent",
    "agent_config",
    "session_agent",
    "session",
    "artifact",
    "turn",
    "item",
    "event",
    "SESSION_STATUS_PAYLOADS",
    "deleted",
    "cursor_page",
    "json_or",
]

T = TypeVar("T")

_ENV_STATUS = {
    environment_pb2.ENVIRONMENT_STATUS_PENDING: "pending",
    # Setup in progress is still "pending" on the wire: the SDK has no
    # initializing state.
    environment_pb2.ENVIRONMENT_STATUS_INITIALIZING: "pending",
    environment_pb2.ENVIRONMENT_STATUS_READY: "ready",
    environment_pb2.ENVIRONMENT_STATUS_FAILED: "failed",
}
_LIFETIME = {environment_pb2.LIFETIME_PRIVATE: "private", environment_pb2.LIFETIME_SHARED: "shared"}
_NETWORK = {
    common_pb2.NETWORK_ACCESS_ENABLED: "enabled",
    common_pb2.NETWORK_ACCESS_DISABLED: "disabled",
    common_pb2.NETWORK_ACCESS_RESTRICTED: "restricted",
}
_SESSION_STATUS = {
    session_pb2.SESSION_STATUS_IDLE: "idle",
    session_pb2.SESSION_STATUS_IN_PROGRESS: "in_progress",
    session_pb2.SESSION_STATUS_REQUIRES_ACTION: "requires_action",
    session_pb2.SESSION_STATUS_FAILED: "failed",
    session_pb2.SESSION_STATUS_BUDGET_REACHED: "budget_reached",
}
_CONTAINER_SIZES = frozenset({"small", "medium", "large"})


def seconds(ts: Timestamp) -> int:
    return int(ts.seconds)


def json_or(text: str, default: T) -> Any | T:
    """Parses service-produced JSON; empty means ``default``."""
    if not text:
        return default
    return json.loads(text)


def environment_status(env: environment_pb2.Environment) -> str:
    return _ENV_STATUS.get(env.status, "pending")


def _files(env: environment_pb2.Environment) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for f in env.config.files:
        size = f.size_bytes or len(f.data)
        if f.WhichOneof("source") == "file_id":
            out.append({"type": "file_id", "id": f.id, "file_id": f.file_id, "path": f.path, "size_bytes": size})
        else:
            out.append({"type": "inline", "id": f.id, "path": f.path, "size_bytes": size})
    return out


def _skills(skills_json: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for skill in json_or(skills_json, []):
        if skill.get("type") == "skill_reference":
            skill_id = str(skill.get("skill_id", ""))
            out.append(
                {
                    "type": "skill_reference",
                    "skill_id": skill_id,
                    "version": str(skill.get("version") or "latest"),
                    "name": str(skill.get("name") or skill_id),
                    "description": str(skill.get("description") or ""),
                }
            )
        else:
            out.append(
                {"type": "inline", "name": str(skill.get("name", "")), "description": str(skill.get("description", ""))}
            )
    return out


def _plugins(plugins_json: str) -> list[dict[str, Any]]:
    return [
        {"type": "inline", "name": str(p.get("name", "")), "description": str(p.get("description", ""))}
        for p in json_or(plugins_json, [])
    ]


def _network(policy: common_pb2.NetworkPolicy) -> dict[str, Any]:
    return {
        "access": _NETWORK.get(policy.access, "enabled"),
        "allowed_domains": list(policy.allowed_domains),
        "blocked_domains": list(policy.blocked_domains),
    }


def _packages(packages: environment_pb2.Packages) -> dict[str, list[str]]:
    return {"npm": list(packages.npm), "python": list(packages.python), "system": list(packages.system)}


def _error(env: environment_pb2.Environment) -> dict[str, str] | None:
    if not env.HasField("error") or not (env.error.code or env.error.message):
        return None
    return {"code": env.error.code, "message": env.error.message}


def _berth_fields(env: environment_pb2.Environment) -> dict[str, Any]:
    """Fields shared by both environment shapes, beyond what the SDK requires."""
    cfg = env.config
    return {
        "capability_directories": list(cfg.capability_directories),
        "network": _network(cfg.network),
        "packages": _packages(cfg.packages),
        "container_size": cfg.container_size if cfg.container_size in _CONTAINER_SIZES else None,
        "lifetime": _LIFETIME.get(env.lifetime, "private"),
        "session_count": int(env.session_count),
        "error": _error(env),
        "created_at": seconds(env.create_time),
    }


def environment_info(env: environment_pb2.Environment) -> dict[str, Any]:
    """``EnvironmentInfo`` (object ``agent.environment``)."""
    return {
        "id": env.id,
        "object": "agent.environment",
        "type": "openai_hosted",
        "status": environment_status(env),
        "files": _files(env),
        "skills": _skills(env.config.skills_json),
        "plugins": _plugins(env.config.plugins_json),
        "vault_ids": list(env.vault_ids),
        **_berth_fields(env),
    }


def hosted_environment(env: environment_pb2.Environment) -> dict[str, Any]:
    """``EnvironmentResourceOpenAIHosted``: a session's ``environment``."""
    return {
        "type": "openai_hosted",
        "id": env.id,
        "files": _files(env),
        "skills": _skills(env.config.skills_json),
        "plugins": _plugins(env.config.plugins_json),
        "status": environment_status(env),
        **_berth_fields(env),
    }


def environment_template(t: environment_pb2.EnvironmentTemplate) -> dict[str, Any]:
    """``EnvironmentTemplate`` (object ``agent.environment.template``): safe
    metadata only, never file contents, env values or setup commands."""
    cfg = t.config
    files: list[dict[str, Any]] = []
    for f in cfg.files:
        if f.WhichOneof("source") == "file_id":
            files.append({"type": "file_id", "file_id": f.file_id, "path": f.path})
        else:
            files.append({"type": "inline", "path": f.path, "size_bytes": int(f.size_bytes)})
    network = _network(cfg.network)
    return {
        "id": t.id,
        "object": "agent.environment.template",
        "name": t.name if t.HasField("name") else None,
        "capability_directories": list(cfg.capability_directories),
        "files": files,
        "network": network,
        "packages": _packages(cfg.packages),
        "plugins": _plugins(cfg.plugins_json),
        "skills": _skills(cfg.skills_json),
        "desktop": None,
        "created_at": seconds(t.create_time),
        "updated_at": seconds(t.update_time),
    }


def environment_file(env_id: str, path: str, size_bytes: int, **extra: Any) -> dict[str, Any]:
    """``EnvironmentFile`` (object ``agent.environment.file``)."""
    return {"object": "agent.environment.file", "environment_id": env_id, "path": path, "size_bytes": size_bytes, **extra}


def registered_file(f: environment_pb2.RegisteredFile) -> dict[str, Any]:
    extra: dict[str, Any] = {"id": f.id, "type": f.source or "inline"}
    if f.file_id:
        extra["file_id"] = f.file_id
    return environment_file(f.environment_id, f.path, int(f.size_bytes), **extra)


def stored_file(f: environment_pb2.StoredFile) -> dict[str, Any]:
    """``FileObject`` (object ``file``)."""
    return {
        "id": f.id,
        "object": "file",
        "bytes": int(f.size_bytes),
        "created_at": seconds(f.create_time),
        "filename": f.filename,
        "purpose": f.purpose,
        "status": "processed",
        "expires_at": seconds(f.expire_time) if f.HasField("expire_time") else None,
        "status_details": None,
    }


def _tool(t: session_pb2.Tool, *, saved: bool) -> dict[str, Any] | None:
    """Credentials never reach the gateway; headers show on saved agents only."""
    if t.WhichOneof("tool") == "tool_search" and not saved:
        # Session snapshots have no tool_search variant (strict clients reject it).
        return None
    return tool_json(t, headers=saved, credentials=False)


def agent_config(c: session_pb2.AgentConfig, *, saved: bool) -> dict[str, Any]:
    """The configuration fields of ``Agent`` and ``AgentSession.agent``."""
    fmt: dict[str, Any] = {"type": "text"}
    if c.text.format.WhichOneof("format") == "json_schema":
        fmt = {"type": "json_schema", "schema": from_struct(c.text.format.json_schema.schema)}
    out: dict[str, Any] = {
        "model": c.model,
        "instructions": c.instructions if c.HasField("instructions") else None,
        "multi_agent": {
            "enabled": c.multi_agent.enabled,
            "max_concurrent_subagents": (
                c.multi_agent.max_concurrent_subagents if c.multi_agent.HasField("max_concurrent_subagents") else None
            ),
        },
        "reasoning": {
            "effort": c.reasoning.effort if c.reasoning.HasField("effort") else None,
            "summary": c.reasoning.summary if c.reasoning.HasField("summary") else None,
        },
        "service_tier": c.service_tier or "auto",
        "text": {"format": fmt, "verbosity": c.text.verbosity or "medium"},
        "tools": [t for t in (_tool(tool, saved=saved) for tool in c.tools) if t is not None],
    }
    if c.HasField("compaction"):
        out["compaction"] = {"async": c.compaction.run_async}
    if c.HasField("experimental"):
        out["experimental"] = {"time_awareness": c.experimental.time_awareness}
    return out


def agent(a: session_pb2.Agent) -> dict[str, Any]:
    """A saved ``Agent`` (object ``agent``)."""
    return {
        "id": a.id,
        "object": "agent",
        "created_at": seconds(a.create_time),
        "updated_at": seconds(a.update_time) or seconds(a.create_time),
        "name": a.name if a.HasField("name") else None,
        "metadata": dict(a.metadata),
        **agent_config(a.config, saved=True),
    }


def session_agent(a: session_pb2.SessionAgent) -> dict[str, Any]:
    """``AgentSession.agent``: the snapshot; credentials are never included."""
    return {"id": a.id, "name": a.name if a.HasField("name") else None, **agent_config(a.config, saved=False)}


def session(s: session_pb2.Session, environment: environment_pb2.Environment | None = None) -> dict[str, Any]:
    """``AgentSession`` (object ``agent.session``). ``environment`` overrides
    the embedded one (when the service did not embed it)."""
    snapshot = session_agent(s.agent)
    snapshot["id"] = s.agent.id or s.agent_id
    if s.environment_kind == session_pb2.ENVIRONMENT_KIND_HOSTED:
        env = environment if environment is not None else s.environment
        if not env.id:
            env = environment_pb2.Environment(id=s.environment_id)
        rendered_env: dict[str, Any] = hosted_environment(env)
    else:
        rendered_env = {"type": "none"}
    created = seconds(s.create_time)
    return {
        "id": s.id,
        "object": "agent.session",
        "agent": snapshot,
        "created_at": created,
        "last_active_at": seconds(s.last_active_time) or created,
        "environment": rendered_env,
        "error": s.error or None,
        "metadata": dict(s.metadata),
        "required_actions": [to_wire(a) for a in s.required_actions],
        "status": _SESSION_STATUS.get(s.status, "idle"),
        "usage": to_wire(s.usage) if s.HasField("usage") else None,
        "vault_ids": list(s.vault_ids),
        "review": s.controls.review or None,
        "prompt_cache_options": {"ttl": s.controls.prompt_cache_ttl} if s.controls.prompt_cache_ttl else None,
        # The limit is null for an unlimited session; ``consumed`` is null
        # when the spend is unavailable (an unpriced model, a subagent's session).
        "spend_control": {
            "limit": int(s.controls.spend_limit_cents) if s.controls.HasField("spend_limit_cents") else None,
            "consumed": int(s.spend_consumed_cents) if s.HasField("spend_consumed_cents") else None,
        },
    }


def artifact(a: session_pb2.Artifact) -> dict[str, Any]:
    """``SessionArtifact`` (object ``agent.session.artifact``)."""
    return {
        "id": a.id,
        "object": "agent.session.artifact",
        "created_at": seconds(a.create_time),
        "environment_id": a.environment_id,
        "path": a.path,
        "session_id": a.session_id,
        "size_bytes": int(a.size_bytes),
        "turn_id": a.turn_id,
    }


def turn(t: session_pb2.Turn) -> dict[str, Any]:
    """``Turn`` (object ``agent.session.turn``)."""
    return to_wire(t)


def trace(t: session_pb2.SessionTrace) -> dict[str, Any]:
    """``SessionTrace`` (object ``agent.session.trace``, OTLP JSON in ``otlp``)."""
    return to_wire(t)


def item(i: session_pb2.Item) -> dict[str, Any]:
    """``AgentSessionItem``: one member per item type."""
    return to_wire(i)


def subagent(s: session_pb2.Subagent) -> dict[str, Any]:
    """``Subagent`` (object ``agent.session.subagent``)."""
    return to_wire(s)


SESSION_STATUS_PAYLOADS = frozenset(
    {
        "session_created",
        "session_in_progress",
        "session_idle",
        "session_requires_action",
        "session_failed",
        "session_budget_reached",
    }
)


def event(e: session_pb2.SessionEvent) -> dict[str, Any]:
    """``AgentSessionEvent``: the envelope and the payload of its type; the
    session of a status event is rendered as ``AgentSession``."""
    out = to_wire(e)
    kind = e.WhichOneof("payload")
    if kind in SESSION_STATUS_PAYLOADS:
        status_event: session_pb2.SessionStatusEvent = getattr(e, kind)
        out["session"] = session(status_event.session)
    return out


def deleted(object_id: str, object_type: str) -> dict[str, Any]:
    return {"id": object_id, "object": object_type, "deleted": True}


def cursor_page(data: Sequence[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """The cursor page every list but environment files uses."""
    return {
        "object": "list",
        "data": list(data),
        "first_id": data[0].get("id") if data else None,
        "last_id": data[-1].get("id") if data else None,
        "has_more": has_more,
    }



def vault(v: vault_pb2.Vault) -> dict[str, Any]:
    return {
        "id": v.id,
        "object": "vault",
        "created_at": seconds(v.create_time),
        "metadata": dict(v.metadata),
        "name": v.name if v.HasField("name") else None,
    }


def _oauth_refresh(refresh: vault_pb2.OAuthRefresh) -> dict[str, Any]:
    """Public refresh metadata: no refresh token, no client secret."""
    return {
        "client_id": refresh.client_id,
        "token_endpoint": refresh.token_endpoint,
        "token_endpoint_auth": {"type": refresh.token_endpoint_auth_type},
        "resource": refresh.resource if refresh.HasField("resource") else None,
        "scope": refresh.scope if refresh.HasField("scope") else None,
    }


def _credential_auth(auth: vault_pb2.CredentialAuth) -> dict[str, Any]:
    """The public part of a credential's auth; the secrets never reach the gateway."""
    if auth.type == "mcp_oauth":
        return {
            "type": auth.type,
            "mcp_server_url": auth.mcp_server_url,
            "expires_at": auth.expires_at if auth.HasField("expires_at") else None,
            "refresh": _oauth_refresh(auth.refresh) if auth.HasField("refresh") else None,
        }
    if auth.type == "environment_variable":
        networking: dict[str, Any] = {"type": auth.networking.type}
        if auth.networking.type == "limited":
            networking["allowed_hosts"] = list(auth.networking.allowed_hosts)
        return {"type": auth.type, "secret_name": auth.secret_name, "networking": networking}
    return {"type": auth.type, "mcp_server_url": auth.mcp_server_url}


def vault_credential(c: vault_pb2.Credential) -> dict[str, Any]:
    return {
        "id": c.id,
        "object": "vault.credential",
        "auth": _credential_auth(c.auth),
        "created_at": seconds(c.create_time),
        "updated_at": seconds(c.update_time),
        "metadata": dict(c.metadata),
        "name": c.name,
        "vault_id": c.vault_id,
    }
