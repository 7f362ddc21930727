"""Agent configuration: validation, normalization, resolution and rendering.

A configuration is kept as one normalized dict with every default filled in:
``model, instructions, multi_agent, reasoning, service_tier, text, tools,
compaction, experimental``. Session snapshots keep MCP credentials
(``authorization``, stdio ``env``) for the harness; they are never rendered.
Saved agents never store credentials (the persisted tool shapes have none).
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

from services.core.errors import InvalidArgument

__all__ = [
    "AgentConfig",
    "ENVIRONMENT_TOOL_NAMES",
    "normalize_agent_create",
    "apply_agent_update",
    "resolve_session_agent",
    "apply_session_agent_update",
    "render_saved_agent",
    "render_session_agent",
    "validate_metadata",
    "function_tools",
]

AgentConfig = dict[str, Any]

# Names the harness reserves for environment tools.
ENVIRONMENT_TOOL_NAMES = frozenset({"exec_command", "read_file", "write_file"})

_SERVICE_TIERS = ("auto", "default", "flex", "priority", "fast", "ultrafast")
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_SUMMARIES = ("concise", "detailed", "auto")
_VERBOSITY = ("low", "medium", "high")
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_MAX_TOOLS_BYTES = 3 * 1024 * 1024
_CONFIG_KEYS = (
    "model",
    "instructions",
    "multi_agent",
    "reasoning",
    "service_tier",
    "text",
    "tools",
    "compaction",
    "experimental",
)


def _fail(param: str, message: str) -> InvalidArgument:
    return InvalidArgument(message, param=param)


def _expect_dict(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(param, f"{param} must be an object")
    return value


def _expect_str(value: Any, param: str, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str) or (not allow_empty and not value.strip()):
        raise _fail(param, f"{param} must be a non-empty string")
    return value


def _expect_bool(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(param, f"{param} must be a boolean")
    return value


def _expect_str_list(value: Any, param: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _fail(param, f"{param} must be a list of strings")
    return list(value)


def _choice(value: Any, allowed: tuple[str, ...], param: str) -> str:
    if value not in allowed:
        raise _fail(param, f"{param} must be one of {', '.join(allowed)}")
    return str(value)


def validate_metadata(value: Any, param: str = "metadata") -> dict[str, str]:
    """Up to 16 pairs, keys up to 64 and values up to 512 characters; null is {}."""
    if value is None:
        return {}
    data = _expect_dict(value, param)
    if len(data) > 16:
        raise _fail(param, "metadata can have at most 16 pairs")
    for key, val in data.items():
        if not isinstance(key, str) or not 1 <= len(key) <= 64:
            raise _fail(f"{param}.{key}", "metadata keys must be 1 to 64 characters")
        if not isinstance(val, str) or len(val) > 512:
            raise _fail(f"{param}.{key}", "metadata values must be strings of at most 512 characters")
    return dict(data)


def _default_config(model: str) -> AgentConfig:
    return {
        "model": model,
        "instructions": None,
        "multi_agent": {"enabled": False, "max_concurrent_subagents": None},
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "auto",
        "text": {"format": {"type": "text"}, "verbosity": "medium"},
        "tools": [],
        "compaction": None,
        "experimental": None,
    }


def _multi_agent(value: Any, param: str) -> dict[str, Any]:
    if value is None:
        return {"enabled": False, "max_concurrent_subagents": None}
    data = _expect_dict(value, param)
    enabled = _expect_bool(data.get("enabled"), f"{param}.enabled")
    if enabled:
        # Native multi-agent orchestration is not implemented; accepting the
        # flag would promise subagent tools the harness cannot provide.
        raise _fail(f"{param}.enabled", "multi-agent execution is not supported")
    return {"enabled": False, "max_concurrent_subagents": None}


def _reasoning(value: Any, param: str, current: dict[str, Any] | None = None) -> dict[str, Any]:
    if value is None:
        return {"effort": None, "summary": None}
    data = _expect_dict(value, param)
    out = dict(current or {"effort": None, "summary": None})
    if "effort" in data:
        out["effort"] = None if data["effort"] is None else _choice(data["effort"], _EFFORTS, f"{param}.effort")
    if "summary" in data:
        out["summary"] = None if data["summary"] is None else _choice(data["summary"], _SUMMARIES, f"{param}.summary")
    return out


def _text(value: Any, param: str) -> dict[str, Any]:
    out: dict[str, Any] = {"format": {"type": "text"}, "verbosity": "medium"}
    if value is None:
        return out
    data = _expect_dict(value, param)
    fmt = data.get("format")
    if fmt is not None:
        fmt = _expect_dict(fmt, f"{param}.format")
        kind = _choice(fmt.get("type"), ("text", "json_schema"), f"{param}.format.type")
        if kind == "json_schema":
            schema = _expect_dict(fmt.get("schema"), f"{param}.format.schema")
            out["format"] = {"type": "json_schema", "schema": schema}
    if data.get("verbosity") is not None:
        out["verbosity"] = _choice(data["verbosity"], _VERBOSITY, f"{param}.verbosity")
    return out


def _compaction(value: Any, param: str) -> dict[str, Any] | None:
    if value is None:
        return None
    data = _expect_dict(value, param)
    flag = data.get("async")
    return {"async": bool(_expect_bool(flag, f"{param}.async")) if flag is not None else False}


def _experimental(value: Any, param: str, current: dict[str, Any] | None = None) -> dict[str, Any] | None:
    if value is None:
        return current
    data = _expect_dict(value, param)
    out = dict(current or {"time_awareness": False})
    if "time_awareness" in data:
        out["time_awareness"] = _expect_bool(data["time_awareness"], f"{param}.time_awareness")
    return out


def _mcp_transport(value: Any, param: str, *, persisted: bool) -> dict[str, Any]:
    data = _expect_dict(value, param)
    kind = _choice(data.get("type"), ("http", "stdio"), f"{param}.type")
    if kind == "http":
        out: dict[str, Any] = {"type": "http", "server_url": _expect_str(data.get("server_url"), f"{param}.server_url")}
        headers = data.get("headers")
        if headers is not None:
            hdrs = _expect_dict(headers, f"{param}.headers")
            if not all(isinstance(v, str) for v in hdrs.values()):
                raise _fail(f"{param}.headers", "headers must map strings to strings")
            out["headers"] = dict(hdrs)
        else:
            out["headers"] = {}
        if data.get("authorization") is not None:
            if persisted:
                raise _fail(f"{param}.authorization", "saved agents do not store credentials")
            out["authorization"] = _expect_str(data["authorization"], f"{param}.authorization")
        return out
    out = {
        "type": "stdio",
        "command": _expect_str(data.get("command"), f"{param}.command"),
        "cwd": _expect_str(data.get("cwd"), f"{param}.cwd"),
        "args": _expect_str_list(data.get("args"), f"{param}.args"),
        "env_vars": _expect_str_list(data.get("env_vars"), f"{param}.env_vars"),
    }
    if data.get("env") is not None:
        if persisted:
            raise _fail(f"{param}.env", "saved agents do not store credentials")
        env = _expect_dict(data["env"], f"{param}.env")
        out["env"] = {str(k): str(v) for k, v in env.items()}
    return out


def _normalize_tool(raw: Any, param: str, *, persisted: bool) -> dict[str, Any]:
    data = _expect_dict(raw, param)
    kind = data.get("type")
    if kind == "function":
        name = _expect_str(data.get("name"), f"{param}.name")
        if not _FUNCTION_NAME.match(name):
            raise _fail(f"{param}.name", "function names use 1 to 64 letters, digits, _ or -")
        if name in ENVIRONMENT_TOOL_NAMES:
            raise _fail(f"{param}.name", f"{name} is reserved for the environment tool of the same name")
        description = data.get("description")
        if description is not None and not isinstance(description, str):
            raise _fail(f"{param}.description", "description must be a string")
        parameters = _expect_dict(data.get("parameters", {"type": "object", "properties": {}}), f"{param}.parameters")
        tool: dict[str, Any] = {
            "type": "function",
            "name": name,
            "description": description or "",
            "parameters": parameters,
            "defer_loading": _expect_bool(data.get("defer_loading", False), f"{param}.defer_loading"),
        }
        if data.get("async") is not None:
            tool["async"] = _expect_bool(data["async"], f"{param}.async")
        return tool
    if kind == "mcp":
        origin = data.get("connection_origin") or "service"
        return {
            "type": "mcp",
            "server_label": _expect_str(data.get("server_label"), f"{param}.server_label"),
            "transport": _mcp_transport(data.get("transport"), f"{param}.transport", persisted=persisted),
            "connection_origin": _choice(origin, ("service", "environment"), f"{param}.connection_origin"),
            "request_metadata": dict(_expect_dict(data.get("request_metadata") or {}, f"{param}.request_metadata")),
            "required": _expect_bool(data.get("required", False), f"{param}.required"),
            "allowed_tools": (
                None
                if data.get("allowed_tools") is None
                else _expect_str_list(data.get("allowed_tools"), f"{param}.allowed_tools")
            ),
            "credential_id": data.get("credential_id"),
        }
    if kind == "web_search":
        return {
            "type": "web_search",
            "allowed_domains": (
                None
                if data.get("allowed_domains") is None
                else _expect_str_list(data["allowed_domains"], f"{param}.allowed_domains")
            ),
            "context_size": _choice(data.get("context_size") or "medium", ("low", "medium", "high"), f"{param}.context_size"),
            "location": data.get("location"),
            "mode": _choice(data.get("mode") or "live", ("disabled", "cached", "live"), f"{param}.mode"),
        }
    if kind == "computer_use":
        return {
            "type": "computer_use",
            "include_screenshots": _expect_bool(data.get("include_screenshots", False), f"{param}.include_screenshots"),
        }
    if kind == "programmatic_tool_calling":
        return {"type": "programmatic_tool_calling", "enabled": _expect_bool(data.get("enabled", True), f"{param}.enabled")}
    if kind in ("automations", "tool_search"):
        return {"type": kind}
    raise _fail(f"{param}.type", f"unsupported tool type {kind!r}")


def _tools(value: Any, param: str, *, persisted: bool) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _fail(param, f"{param} must be a list")
    if len(json.dumps(value, separators=(",", ":")).encode()) > _MAX_TOOLS_BYTES:
        raise _fail(param, "the tool list must fit within 3 MiB of compact JSON")
    tools = [_normalize_tool(raw, f"{param}[{i}]", persisted=persisted) for i, raw in enumerate(value)]
    seen_functions: set[str] = set()
    seen_labels: set[str] = set()
    for i, tool in enumerate(tools):
        if tool["type"] == "function":
            if tool["name"] in seen_functions:
                raise _fail(f"{param}[{i}].name", f"duplicate function name {tool['name']!r}")
            seen_functions.add(tool["name"])
        elif tool["type"] == "mcp":
            if tool["server_label"] in seen_labels:
                raise _fail(f"{param}[{i}].server_label", f"duplicate server_label {tool['server_label']!r}")
            seen_labels.add(tool["server_label"])
    return tools


def _apply_fields(config: AgentConfig, body: dict[str, Any], prefix: str, *, persisted: bool) -> AgentConfig:
    """Applies the config fields present in ``body`` (absent = unchanged,
    null = reset) to a copy of ``config``."""
    out = copy.deepcopy(config)
    p = f"{prefix}." if prefix else ""
    if "model" in body:
        out["model"] = _expect_str(body["model"], f"{p}model")
    if "instructions" in body:
        value = body["instructions"]
        if value is not None and not isinstance(value, str):
            raise _fail(f"{p}instructions", "instructions must be a string")
        out["instructions"] = value
    if "multi_agent" in body:
        out["multi_agent"] = _multi_agent(body["multi_agent"], f"{p}multi_agent")
    if "reasoning" in body:
        out["reasoning"] = _reasoning(body["reasoning"], f"{p}reasoning")
    if "service_tier" in body:
        value = body["service_tier"]
        out["service_tier"] = "auto" if value is None else _choice(value, _SERVICE_TIERS, f"{p}service_tier")
    if "text" in body:
        out["text"] = _text(body["text"], f"{p}text")
    if "tools" in body:
        out["tools"] = _tools(body["tools"], f"{p}tools", persisted=persisted)
    if "compaction" in body:
        out["compaction"] = _compaction(body["compaction"], f"{p}compaction")
    if "experimental" in body:
        out["experimental"] = _experimental(body["experimental"], f"{p}experimental", out.get("experimental"))
    return out


def normalize_agent_create(body: dict[str, Any]) -> tuple[str | None, dict[str, str], AgentConfig]:
    """Validates an agent create body; returns (name, metadata, config)."""
    model = _expect_str(body.get("model"), "model")
    config = _apply_fields(_default_config(model), body, "", persisted=True)
    name = body.get("name")
    if name is not None and not isinstance(name, str):
        raise _fail("name", "name must be a string")
    return name, validate_metadata(body.get("metadata")), config


def apply_agent_update(
    name: str | None, metadata: dict[str, str], config: AgentConfig, body: dict[str, Any]
) -> tuple[str | None, dict[str, str], AgentConfig]:
    """Applies an agent update body: absent keys are unchanged, null clears."""
    new_config = _apply_fields(config, body, "", persisted=True)
    if "name" in body:
        if body["name"] is not None and not isinstance(body["name"], str):
            raise _fail("name", "name must be a string")
        name = body["name"]
    if "metadata" in body:
        metadata = validate_metadata(body["metadata"])
    return name, metadata, new_config


def resolve_session_agent(saved: AgentConfig | None, overrides: dict[str, Any] | None) -> AgentConfig:
    """The session snapshot: the saved config with the supplied overrides, or
    an inline config (which then needs ``model``)."""
    body = overrides or {}
    for key in ("name", "metadata"):
        if key in body:
            raise _fail(f"agent.{key}", f"agent.{key} is not part of an inline agent configuration")
    unknown = sorted(set(body) - set(_CONFIG_KEYS))
    if unknown:
        raise _fail(f"agent.{unknown[0]}", f"unknown agent field {unknown[0]!r}")
    if saved is None:
        base = _default_config(_expect_str(body.get("model"), "agent.model"))
    else:
        base = copy.deepcopy(saved)
    return _apply_fields(base, body, "agent", persisted=False)


def apply_session_agent_update(config: AgentConfig, body: Any) -> AgentConfig:
    """SessionUpdateParams.agent: model, reasoning.effort, service_tier, tools."""
    data = _expect_dict(body, "agent")
    unknown = sorted(set(data) - {"model", "reasoning", "service_tier", "tools"})
    if unknown:
        raise _fail(f"agent.{unknown[0]}", f"agent.{unknown[0]} cannot be updated on a session")
    out = copy.deepcopy(config)
    if "model" in data:
        out["model"] = _expect_str(data["model"], "agent.model")
    if "reasoning" in data:
        reasoning = _expect_dict(data["reasoning"], "agent.reasoning")
        if set(reasoning) - {"effort"}:
            raise _fail("agent.reasoning", "only agent.reasoning.effort can be updated")
        out["reasoning"] = _reasoning(reasoning, "agent.reasoning", out.get("reasoning"))
    if "service_tier" in data:
        value = data["service_tier"]
        out["service_tier"] = "auto" if value is None else _choice(value, _SERVICE_TIERS, "agent.service_tier")
    if "tools" in data:
        out["tools"] = _tools(data["tools"], "agent.tools", persisted=False)
    return out


def _public_tool(tool: dict[str, Any], *, persisted: bool) -> dict[str, Any] | None:
    if tool["type"] == "tool_search":
        # Session snapshots have no tool_search variant (strict clients reject it).
        return dict(tool) if persisted else None
    if tool["type"] != "mcp":
        return copy.deepcopy(tool)
    out = copy.deepcopy(tool)
    transport = out["transport"]
    if transport["type"] == "http":
        shown: dict[str, Any] = {"type": "http", "server_url": transport["server_url"]}
        if persisted:
            shown["headers"] = dict(transport.get("headers") or {})
        out["transport"] = shown
    else:
        out["transport"] = {k: transport[k] for k in ("type", "command", "cwd", "args", "env_vars")}
    return out


def _public_config(config: AgentConfig, *, persisted: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": config["model"],
        "instructions": config.get("instructions"),
        "multi_agent": dict(config["multi_agent"]),
        "reasoning": dict(config["reasoning"]),
        "service_tier": config["service_tier"],
        "text": copy.deepcopy(config["text"]),
        "tools": [t for t in (_public_tool(tool, persisted=persisted) for tool in config["tools"]) if t is not None],
    }
    if config.get("compaction") is not None:
        out["compaction"] = dict(config["compaction"])
    if config.get("experimental") is not None:
        out["experimental"] = dict(config["experimental"])
    return out


def render_saved_agent(
    agent_id: str, name: str | None, metadata: dict[str, str], config: AgentConfig, created_at: float, updated_at: float
) -> dict[str, Any]:
    """The `Agent` wire object (object: "agent")."""
    return {
        "id": agent_id,
        "object": "agent",
        "created_at": int(created_at),
        "updated_at": int(updated_at),
        "name": name,
        "metadata": dict(metadata),
        **_public_config(config, persisted=True),
    }


def render_session_agent(agent_id: str, name: str | None, config: AgentConfig) -> dict[str, Any]:
    """The `AgentSession.agent` wire object; credentials are never included."""
    return {"id": agent_id, "name": name, **_public_config(config, persisted=False)}


def function_tools(config: AgentConfig) -> list[dict[str, Any]]:
    return [t for t in config.get("tools", []) if t.get("type") == "function"]
