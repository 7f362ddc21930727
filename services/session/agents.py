"""Agent configuration: the Session service's invariants, defaults, merging
and the mapping between the contract's ``AgentConfig`` and the stored form.

The gateway validates the shape of every body; this module keeps only the
rules the service owns: the tool names the harness reserves, unique function
names and server labels, the subagent bound's default, and no credentials in
saved agents.

A configuration is stored as one normalized dict with every default filled
in: ``model, instructions, multi_agent, reasoning, service_tier, text, tools,
compaction, experimental``. Session snapshots keep MCP credentials
(``authorization``, stdio ``env``) for the harness; they never leave the
service.
"""

from __future__ import annotations

import copy
from collections.abc import Collection
from typing import Any

from berth.session.v1 import session_pb2 as pb
from services.core.agent_tools import tool_json
from services.core.errors import InvalidArgument
from services.core.structs import from_struct, to_struct, to_value

__all__ = [
    "AgentConfig",
    "CONFIG_FIELDS",
    "DEFAULT_MAX_CONCURRENT_SUBAGENTS",
    "ENVIRONMENT_TOOL_NAMES",
    "SUBAGENT_TOOL_NAMES",
    "new_config",
    "apply_config",
    "config_message",
    "function_tools",
]

AgentConfig = dict[str, Any]

# Names the harness reserves for environment tools.
ENVIRONMENT_TOOL_NAMES = frozenset(
    {"exec_command", "read_file", "write_file", "apply_patch", "start_process", "write_stdin", "kill_process"}
)

# Subagents running at once when multi_agent is enabled without a bound
# (the SDK's documented default).
DEFAULT_MAX_CONCURRENT_SUBAGENTS = 6

# Names the harness reserves for the subagent tools (multi_agent).
SUBAGENT_TOOL_NAMES = frozenset(
    {
        "create_subagent",
        "send_subagent_input",
        "wait_for_subagents",
        "interrupt_subagent",
        "resume_subagent",
        "close_subagent",
    }
)

# The top-level fields of AgentConfig, as the contract declares them.
CONFIG_FIELDS = tuple(f.name for f in pb.AgentConfig.DESCRIPTOR.fields)
# Every path a create applies: a new config takes each field as given.
_ALL_PATHS = frozenset(CONFIG_FIELDS) | {"experimental.time_awareness"}


def _fail(param: str, message: str) -> InvalidArgument:
    return InvalidArgument(message, param=param)


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


# --- contract -> stored form ----------------------------------------------------------


_DEFAULT_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def _tool(t: pb.Tool) -> dict[str, Any]:
    """The stored form: the tool with its credentials, unset fields at the
    service's defaults."""
    kind = t.WhichOneof("tool")
    if kind is None:
        raise _fail("tools", "a tool needs a type")
    out = tool_json(t, headers=True, credentials=True)
    if kind == "function" and not t.function.HasField("parameters"):
        out["parameters"] = copy.deepcopy(_DEFAULT_PARAMETERS)
    elif kind == "mcp":
        out["connection_origin"] = out["connection_origin"] or "service"
    elif kind == "web_search":
        out["context_size"] = out["context_size"] or "medium"
        out["mode"] = out["mode"] or "live"
    elif kind == "programmatic_tool_calling" and not t.programmatic_tool_calling.HasField("enabled"):
        out["enabled"] = True
    return out


def _tools(tools: Collection[pb.Tool], param: str, *, persisted: bool) -> list[dict[str, Any]]:
    out = [_tool(t) for t in tools]
    seen_functions: set[str] = set()
    seen_labels: set[str] = set()
    for i, tool in enumerate(out):
        p = f"{param}[{i}]"
        if tool["type"] == "function":
            name = tool["name"]
            if name in ENVIRONMENT_TOOL_NAMES or name in SUBAGENT_TOOL_NAMES:
                raise _fail(f"{p}.name", f"{name} is reserved for the harness tool of the same name")
            if name in seen_functions:
                raise _fail(f"{p}.name", f"duplicate function name {name!r}")
            seen_functions.add(name)
        elif tool["type"] == "mcp":
            label = tool["server_label"]
            if label in seen_labels:
                raise _fail(f"{p}.server_label", f"duplicate server_label {label!r}")
            seen_labels.add(label)
            if persisted:
                transport = tool["transport"]
                for secret in ("authorization", "env"):
                    if secret in transport:
                        raise _fail(f"{p}.transport.{secret}", "saved agents do not store credentials")
    return out


def _text(text: pb.TextConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"format": {"type": "text"}, "verbosity": text.verbosity or "medium"}
    if text.format.WhichOneof("format") == "json_schema":
        out["format"] = {"type": "json_schema", "schema": from_struct(text.format.json_schema.schema)}
    return out


def apply_config(
    base: AgentConfig, config: pb.AgentConfig, paths: Collection[str], *, prefix: str = "", persisted: bool
) -> AgentConfig:
    """A copy of ``base`` with the fields named in ``paths`` taken from
    ``config``; a named field left unset is reset to its default. The
    service's invariants are checked on what changes."""
    out = copy.deepcopy(base)
    p = f"{prefix}." if prefix else ""
    if "model" in paths:
        if not config.model.strip():
            raise _fail(f"{p}model", f"{p}model must be a non-empty string")
        out["model"] = config.model
    if "instructions" in paths:
        out["instructions"] = config.instructions if config.HasField("instructions") else None
    if "multi_agent" in paths:
        m = config.multi_agent
        if m.HasField("max_concurrent_subagents") and m.max_concurrent_subagents < 1:
            raise _fail(f"{p}multi_agent.max_concurrent_subagents", "max_concurrent_subagents must be at least 1")
        bound = m.max_concurrent_subagents if m.HasField("max_concurrent_subagents") else DEFAULT_MAX_CONCURRENT_SUBAGENTS
        # The bound is null when disabled, as the SDK's resolved config says.
        out["multi_agent"] = {"enabled": m.enabled, "max_concurrent_subagents": bound if m.enabled else None}
    if "reasoning" in paths:
        r = config.reasoning
        out["reasoning"] = {
            "effort": r.effort if r.HasField("effort") else None,
            "summary": r.summary if r.HasField("summary") else None,
        }
    elif "reasoning.effort" in paths:
        effort = config.reasoning.effort if config.reasoning.HasField("effort") else None
        out["reasoning"] = {**(out.get("reasoning") or {"summary": None}), "effort": effort}
    if "service_tier" in paths:
        out["service_tier"] = config.service_tier or "auto"
    if "text" in paths:
        out["text"] = _text(config.text) if config.HasField("text") else _default_config("")["text"]
    if "tools" in paths:
        out["tools"] = _tools(config.tools, f"{p}tools", persisted=persisted)
    if "compaction" in paths:
        out["compaction"] = {"async": config.compaction.run_async} if config.HasField("compaction") else None
    if "experimental" in paths and config.HasField("experimental"):
        # Unset keeps what there is; given, it merges into it.
        experimental = dict(out.get("experimental") or {"time_awareness": False})
        if "experimental.time_awareness" in paths:
            experimental["time_awareness"] = config.experimental.time_awareness
        out["experimental"] = experimental
    return out


def new_config(config: pb.AgentConfig, *, prefix: str = "", persisted: bool) -> AgentConfig:
    """A complete configuration from a contract one; unset fields take their defaults."""
    return apply_config(_default_config(""), config, _ALL_PATHS, prefix=prefix, persisted=persisted)


# --- stored form -> contract ----------------------------------------------------------


def _transport_message(t: dict[str, Any]) -> pb.McpTransport:
    """Credentials (``authorization``, stdio ``env``) are never included."""
    if t["type"] == "stdio":
        return pb.McpTransport(
            stdio=pb.McpStdioTransport(command=t["command"], cwd=t["cwd"], args=t["args"], env_vars=t["env_vars"])
        )
    return pb.McpTransport(http=pb.McpHttpTransport(server_url=t["server_url"], headers=t.get("headers") or {}))


def _tool_message(t: dict[str, Any]) -> pb.Tool:
    kind = t["type"]
    if kind == "function":
        f = pb.FunctionTool(
            name=t["name"], description=t["description"], parameters=to_struct(t["parameters"]), defer_loading=t["defer_loading"]
        )
        if "async" in t:
            f.run_async = t["async"]
        return pb.Tool(function=f)
    if kind == "mcp":
        m = pb.McpTool(
            server_label=t["server_label"],
            transport=_transport_message(t["transport"]),
            connection_origin=t["connection_origin"],
            request_metadata=to_struct(t["request_metadata"]),
            required=t["required"],
        )
        if t["allowed_tools"] is not None:
            m.allowed_tools.values.extend(t["allowed_tools"])
        if t["credential_id"] is not None:
            m.credential_id = t["credential_id"]
        return pb.Tool(mcp=m)
    if kind == "web_search":
        w = pb.WebSearchTool(context_size=t["context_size"], mode=t["mode"])
        if t["allowed_domains"] is not None:
            w.allowed_domains.values.extend(t["allowed_domains"])
        if t.get("location") is not None:
            w.location.CopyFrom(to_value(t["location"]))
        return pb.Tool(web_search=w)
    if kind == "computer_use":
        return pb.Tool(computer_use=pb.ComputerUseTool(include_screenshots=t["include_screenshots"]))
    if kind == "programmatic_tool_calling":
        return pb.Tool(programmatic_tool_calling=pb.ProgrammaticToolCallingTool(enabled=t["enabled"]))
    if kind == "tool_search":
        return pb.Tool(tool_search=pb.ToolSearchTool())
    return pb.Tool(automations=pb.AutomationsTool())


def config_message(config: AgentConfig) -> pb.AgentConfig:
    """The stored configuration as the contract's message, without credentials."""
    out = pb.AgentConfig(
        model=config["model"],
        multi_agent=pb.MultiAgentConfig(
            enabled=bool(config["multi_agent"]["enabled"]),
            max_concurrent_subagents=config["multi_agent"].get("max_concurrent_subagents"),
        ),
        service_tier=config["service_tier"],
        tools=[_tool_message(t) for t in config["tools"]],
    )
    if config.get("instructions") is not None:
        out.instructions = config["instructions"]
    reasoning = config["reasoning"]
    out.reasoning.SetInParent()
    if reasoning.get("effort") is not None:
        out.reasoning.effort = reasoning["effort"]
    if reasoning.get("summary") is not None:
        out.reasoning.summary = reasoning["summary"]
    text = config["text"]
    out.text.verbosity = text["verbosity"]
    if text["format"]["type"] == "json_schema":
        out.text.format.json_schema.schema.CopyFrom(to_struct(text["format"]["schema"]))
    else:
        out.text.format.text.SetInParent()
    if config.get("compaction") is not None:
        out.compaction.run_async = bool(config["compaction"]["async"])
        out.compaction.SetInParent()
    if config.get("experimental") is not None:
        out.experimental.time_awareness = bool(config["experimental"].get("time_awareness"))
        out.experimental.SetInParent()
    return out


def function_tools(config: AgentConfig) -> list[dict[str, Any]]:
    return [t for t in config.get("tools", []) if t.get("type") == "function"]
