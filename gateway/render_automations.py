"""Automation contract messages -> Agents API wire JSON (``agent.automation``
and ``agent.automation.invocation``). Setup commands, environment variables
and file contents of a target's inline environment are never rendered."""

from __future__ import annotations

from typing import Any

from berth.common.v1 import common_pb2
from berth.environment.v1 import environment_pb2 as env_pb
from berth.session.v1 import automation_pb2 as pb
from berth.session.v1 import session_service_pb2 as svc_pb
from gateway.render import agent_config, seconds

__all__ = ["automation", "invocation"]

_STATUS = {
    pb.AUTOMATION_STATUS_ACTIVE: "active",
    pb.AUTOMATION_STATUS_PAUSED: "paused",
    pb.AUTOMATION_STATUS_COMPLETED: "completed",
}
_INVOCATION_STATUS = {
    pb.INVOCATION_STATUS_QUEUED: "queued",
    pb.INVOCATION_STATUS_COMPLETED: "completed",
    pb.INVOCATION_STATUS_FAILED: "failed",
    pb.INVOCATION_STATUS_SKIPPED: "skipped",
}
_ACCESS = {
    common_pb2.NETWORK_ACCESS_ENABLED: "enabled",
    common_pb2.NETWORK_ACCESS_DISABLED: "disabled",
    common_pb2.NETWORK_ACCESS_RESTRICTED: "restricted",
}


def _hosted(config: env_pb.EnvironmentConfig) -> dict[str, Any]:
    files = [
        {"type": "file_id", "file_id": f.file_id, "path": f.path}
        if f.WhichOneof("source") == "file_id"
        else {"type": "inline", "path": f.path, "size_bytes": f.size_bytes or len(f.data)}
        for f in config.files
    ]
    packages = config.packages
    network = config.network
    return {
        "type": "openai_hosted",
        "environment_id": None,
        "environment_template_id": None,
        "container_size": config.container_size or None,
        "capability_directories": list(config.capability_directories) or None,
        "files": files or None,
        "packages": (
            {"npm": list(packages.npm), "python": list(packages.python), "system": list(packages.system)}
            if packages.npm or packages.python or packages.system
            else None
        ),
        "network": (
            {"access": _ACCESS[network.access], "allowed_domains": list(network.allowed_domains)}
            if network.access in _ACCESS
            else None
        ),
    }


def _environment(env: svc_pb.SessionEnvironment) -> dict[str, Any]:
    kind = env.WhichOneof("environment")
    if kind == "environment_id":
        return {"type": "openai_hosted", "environment_id": env.environment_id}
    if kind == "inline":
        return _hosted(env.inline)
    return {"type": "none"}


def _input(message: svc_pb.UserMessage) -> dict[str, Any]:
    content = [
        {"type": "input_image", "image_url": part.image_url}
        if part.WhichOneof("content") == "image_url"
        else {"type": "input_text", "text": part.text}
        for part in message.content
    ]
    return {"type": "message", "role": "user", "content": content}


def _target(target: pb.AutomationTarget) -> dict[str, Any]:
    if target.HasField("existing_session"):
        existing = target.existing_session
        return {"type": "existing_session", "session_id": existing.session_id, "instructions": existing.instructions}
    new = target.new_session
    session = new.session
    return {
        "type": "new_session",
        "agent_id": session.agent_id or None,
        "agent": None if session.agent_id else agent_config(new.effective_agent, saved=False),
        "environment": _environment(session.environment),
        "input": [_input(m) for m in session.input],
        "metadata": dict(session.metadata),
        "vault_ids": list(session.vault_ids),
    }


def automation(a: pb.Automation) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": a.id,
        "object": "agent.automation",
        "created_at": seconds(a.create_time),
        "created_by": (
            {"type": "agent", "session_id": a.agent_creator.session_id, "tool_call_id": a.agent_creator.tool_call_id}
            if a.HasField("agent_creator")
            else {"type": "developer"}
        ),
        "metadata": dict(a.metadata),
        "name": a.name,
        "status": _STATUS.get(a.status, "active"),
        "pause_reason": a.pause_reason or None,
        "target": _target(a.target),
    }
    if a.kind == pb.AUTOMATION_KIND_ONCE:
        out.update(type="once", run_at=a.run_at)
    else:
        out.update(type="periodic", expression=a.expression, timezone=a.timezone)
    return out


def invocation(i: pb.AutomationInvocation) -> dict[str, Any]:
    scheduled = i.HasField("scheduled_at")
    return {
        "id": i.id,
        "object": "agent.automation.invocation",
        "automation_id": i.automation_id,
        "created_at": seconds(i.create_time),
        "status": _INVOCATION_STATUS.get(i.status, "queued"),
        "scheduled_at": i.scheduled_at if scheduled else None,
        "session_id": i.session_id or None,
        "skip_reason": i.skip_reason or None,
        "error": {"code": i.error_code, "message": i.error_message} if i.error_code else None,
        "source": {"type": "automation", "automation": automation(i.snapshot)} if scheduled else {"type": "manual"},
    }
