"""Validated request bodies -> contract messages, once per body.

The models of ``gateway.validation`` have checked the shape; this module
only maps them. Partial updates become update masks: a field the caller
named is in the mask, and an explicit ``null`` is a named field left unset
(the service resets it).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from berth.common.v1 import common_pb2
from berth.environment.v1 import environment_pb2 as env_pb
from berth.environment.v1 import environment_service_pb2 as env_pb_svc
from berth.session.v1 import session_pb2 as s_pb
from berth.session.v1 import session_service_pb2 as svc_pb
from services.core.structs import to_struct, to_value
from gateway.validation import (
    AgentCreateBody,
    AgentUpdateBody,
    AutomationsTool,
    ComputerUseTool,
    FileIdFile,
    FunctionTool,
    HostedConfigFields,
    HostedEnvironmentConfig,
    InlineAgent,
    InlineFile,
    InputImage,
    InputMessage,
    McpHttpTransport,
    McpTool,
    NoEnvironment,
    ProgrammaticToolCallingTool,
    Reasoning,
    ReferenceEnvironment,
    SessionAgentUpdate,
    SessionCreateBody,
    SessionHostedEnvironment,
    SessionUpdateBody,
    TemplateBody,
    TextFormatJsonSchema,
    Tool,
    ToolSearchTool,
    WebSearchTool,
    check_agent_config,
    check_session_update,
    decode_base64,
)

__all__ = [
    "environment_config",
    "template_request",
    "update_template_request",
    "create_agent_request",
    "update_agent_request",
    "create_session_request",
    "update_session_request",
]

_ACCESS = {
    "enabled": common_pb2.NETWORK_ACCESS_ENABLED,
    "disabled": common_pb2.NETWORK_ACCESS_DISABLED,
    "restricted": common_pb2.NETWORK_ACCESS_RESTRICTED,
}
# The top-level fields of AgentConfig, as the contract declares them; the
# request models use the same names.
_CONFIG_FIELDS = tuple(f.name for f in s_pb.AgentConfig.DESCRIPTOR.fields)


# --- environments ------------------------------------------------------------------------


# Public configuration field -> EnvironmentConfig field (desktop has none:
# enabling it is refused, disabled is the default).
_CONFIG_FIELD_NAMES = {
    "capability_directories": "capability_directories",
    "container_size": "container_size",
    "env": "env",
    "files": "files",
    "network": "network",
    "packages": "packages",
    "plugins": "plugins_json",
    "setup_commands": "setup_commands",
    "skills": "skills_json",
}


def _config_fields(config: HostedConfigFields, *, with_nulls: bool) -> list[str]:
    """The EnvironmentConfig fields a body sets (a null counts only ``with_nulls``)."""
    return [
        _CONFIG_FIELD_NAMES[name]
        for name in sorted(config.model_fields_set)
        if name in _CONFIG_FIELD_NAMES and (with_nulls or getattr(config, name) is not None)
    ]


def template_request(body: TemplateBody) -> env_pb_svc.CreateEnvironmentTemplateRequest:
    request = env_pb_svc.CreateEnvironmentTemplateRequest(config=environment_config(body))
    if body.name is not None:
        request.name = body.name
    return request


def update_template_request(template_id: str, body: TemplateBody) -> env_pb_svc.UpdateEnvironmentTemplateRequest:
    """Omitted fields are kept; a null one resets to its default (an empty
    value under its name in ``update_fields``)."""
    request = env_pb_svc.UpdateEnvironmentTemplateRequest(
        template_id=template_id,
        config=environment_config(body),
        update_fields=_config_fields(body, with_nulls=True),
        update_name="name" in body.model_fields_set,
    )
    if body.name is not None:
        request.name = body.name
    return request


def environment_config(config: HostedConfigFields) -> env_pb.EnvironmentConfig:
    """An inline ``openai_hosted`` configuration (or a template's) as the
    contract's EnvironmentConfig. Skills and plugins travel as the JSON the
    API received (archives included). With ``environment_template_id`` the
    fields the body sets are named as the template's overrides; a null one
    inherits the template's."""
    out = _environment_config(config)
    if isinstance(config, HostedEnvironmentConfig) and config.environment_template_id is not None:
        out.environment_template_id = config.environment_template_id
        out.template_overrides.extend(_config_fields(config, with_nulls=False))
    return out


def _environment_config(config: HostedConfigFields) -> env_pb.EnvironmentConfig:
    files: list[env_pb.InitialFile] = []
    for f in config.files or []:
        if isinstance(f, InlineFile):
            files.append(env_pb.InitialFile(path=f.path, data=decode_base64(f.data)))
        else:
            assert isinstance(f, FileIdFile)
            files.append(env_pb.InitialFile(path=f.path, file_id=f.file_id))
    network = config.network
    packages = config.packages
    return env_pb.EnvironmentConfig(
        files=files,
        env=config.env or {},
        packages=env_pb.Packages(
            python=(packages.python or []) if packages else [],
            npm=(packages.npm or []) if packages else [],
            system=(packages.system or []) if packages else [],
        ),
        setup_commands=[env_pb.SetupCommand(command=c.command, cwd=c.cwd or "") for c in config.setup_commands or []],
        network=common_pb2.NetworkPolicy(
            access=_ACCESS[network.access] if network else common_pb2.NETWORK_ACCESS_UNSPECIFIED,
            allowed_domains=(network.allowed_domains or []) if network else [],
            blocked_domains=(network.blocked_domains or []) if network else [],
        ),
        skills_json=_json_list(config.skills),
        plugins_json=_json_list(config.plugins),
        capability_directories=config.capability_directories or [],
        container_size=(config.container_size or "") if isinstance(config, HostedEnvironmentConfig) else "",
    )


def _json_list(entries: Sequence[Any] | None) -> str:
    return json.dumps([e.model_dump(mode="json", by_alias=True, exclude_unset=True) for e in entries or []])


# --- agents ------------------------------------------------------------------------------


def _tool(tool: Tool) -> s_pb.Tool:
    if isinstance(tool, FunctionTool):
        f = s_pb.FunctionTool(
            name=tool.name,
            description=tool.description or "",
            parameters=to_struct(tool.parameters),
            defer_loading=bool(tool.defer_loading),
        )
        if tool.async_ is not None:
            f.run_async = tool.async_
        return s_pb.Tool(function=f)
    if isinstance(tool, McpTool):
        t = tool.transport
        transport = s_pb.McpTransport()
        if isinstance(t, McpHttpTransport):
            transport.http.server_url = t.server_url
            transport.http.headers.update(t.headers or {})
            if t.authorization is not None:
                transport.http.authorization = t.authorization
        else:
            transport.stdio.command = t.command
            transport.stdio.cwd = t.cwd
            transport.stdio.args.extend(t.args or [])
            transport.stdio.env_vars.extend(t.env_vars or [])
            if t.env is not None:
                transport.stdio.env.values.update(t.env)
        m = s_pb.McpTool(
            server_label=tool.server_label,
            transport=transport,
            connection_origin=tool.connection_origin or "",
            request_metadata=to_struct(tool.request_metadata or {}),
            required=bool(tool.required),
        )
        if tool.allowed_tools is not None:
            m.allowed_tools.values.extend(tool.allowed_tools)
        if tool.credential_id is not None:
            m.credential_id = tool.credential_id
        return s_pb.Tool(mcp=m)
    if isinstance(tool, WebSearchTool):
        w = s_pb.WebSearchTool(context_size=tool.context_size or "", mode=tool.mode or "")
        if tool.allowed_domains is not None:
            w.allowed_domains.values.extend(tool.allowed_domains)
        if tool.location is not None:
            w.location.CopyFrom(to_value(tool.location))
        return s_pb.Tool(web_search=w)
    if isinstance(tool, ComputerUseTool):
        return s_pb.Tool(computer_use=s_pb.ComputerUseTool(include_screenshots=bool(tool.include_screenshots)))
    if isinstance(tool, ProgrammaticToolCallingTool):
        p = s_pb.ProgrammaticToolCallingTool()
        if tool.enabled is not None:
            p.enabled = tool.enabled
        return s_pb.Tool(programmatic_tool_calling=p)
    if isinstance(tool, ToolSearchTool):
        return s_pb.Tool(tool_search=s_pb.ToolSearchTool())
    assert isinstance(tool, AutomationsTool)
    return s_pb.Tool(automations=s_pb.AutomationsTool())


def _agent_config(body: AgentCreateBody | AgentUpdateBody | InlineAgent | SessionAgentUpdate) -> tuple[s_pb.AgentConfig, list[str]]:
    """The configuration fields the body gives, and their paths."""
    given = body.model_fields_set
    paths = [name for name in _CONFIG_FIELDS if name in given]
    out = s_pb.AgentConfig(model=body.model or "")
    if body.reasoning is not None:
        out.reasoning.SetInParent()
        if body.reasoning.effort is not None:
            out.reasoning.effort = body.reasoning.effort
        if isinstance(body.reasoning, Reasoning) and body.reasoning.summary is not None:
            out.reasoning.summary = body.reasoning.summary
    if body.service_tier is not None:
        out.service_tier = body.service_tier
    out.tools.extend(_tool(t) for t in body.tools or [])
    if isinstance(body, SessionAgentUpdate):
        if "reasoning" in paths:
            # Only the effort of a session's snapshot changes.
            paths.remove("reasoning")
            if body.reasoning is not None and "effort" in body.reasoning.model_fields_set:
                paths.append("reasoning.effort")
        return out, paths
    if body.instructions is not None:
        out.instructions = body.instructions
    if body.multi_agent is not None:
        out.multi_agent.enabled = body.multi_agent.enabled
        if body.multi_agent.max_concurrent_subagents is not None:
            out.multi_agent.max_concurrent_subagents = body.multi_agent.max_concurrent_subagents
    if body.text is not None:
        out.text.SetInParent()
        out.text.verbosity = body.text.verbosity or ""
        fmt = body.text.format
        if isinstance(fmt, TextFormatJsonSchema):
            out.text.format.json_schema.schema.CopyFrom(to_struct(fmt.schema_))
        elif fmt is not None:
            out.text.format.text.SetInParent()
    if body.compaction is not None:
        out.compaction.SetInParent()
        out.compaction.run_async = bool(body.compaction.async_)
    if body.experimental is not None:
        out.experimental.SetInParent()
        if "time_awareness" in body.experimental.model_fields_set:
            out.experimental.time_awareness = bool(body.experimental.time_awareness)
            paths.append("experimental.time_awareness")
    return out, paths


def create_agent_request(body: AgentCreateBody) -> svc_pb.CreateAgentRequest:
    check_agent_config(body)
    config, _ = _agent_config(body)
    out = svc_pb.CreateAgentRequest(config=config, metadata=body.metadata or {})
    if body.name is not None:
        out.name = body.name
    return out


def update_agent_request(agent_id: str, body: AgentUpdateBody) -> svc_pb.UpdateAgentRequest:
    check_agent_config(body)
    config, paths = _agent_config(body)
    out = svc_pb.UpdateAgentRequest(agent_id=agent_id, config=config, metadata=body.metadata or {})
    if body.name is not None:
        out.name = body.name
    out.update_mask.paths.extend(
        [name for name in ("name", "metadata") if name in body.model_fields_set] + [f"config.{p}" for p in paths]
    )
    return out


# --- sessions ----------------------------------------------------------------------------


def _user_messages(value: str | list[InputMessage] | None) -> list[svc_pb.UserMessage]:
    if value is None:
        return []
    if isinstance(value, str):
        return [svc_pb.UserMessage(content=[svc_pb.UserContent(text=value)])]
    return [
        svc_pb.UserMessage(
            content=[
                svc_pb.UserContent(image_url=c.image_url) if isinstance(c, InputImage) else svc_pb.UserContent(text=c.text)
                for c in m.content
            ]
        )
        for m in value
    ]


def _session_environment(env: Any) -> svc_pb.SessionEnvironment:
    if isinstance(env, NoEnvironment):
        return svc_pb.SessionEnvironment(none=svc_pb.NoEnvironment())
    if isinstance(env, ReferenceEnvironment):
        return svc_pb.SessionEnvironment(environment_id=env.environment_id)
    assert isinstance(env, SessionHostedEnvironment)
    if env.environment_id is not None:
        return svc_pb.SessionEnvironment(environment_id=env.environment_id)
    return svc_pb.SessionEnvironment(inline=environment_config(env))


def create_session_request(body: SessionCreateBody) -> svc_pb.CreateSessionRequest:
    """Streaming options are the gateway's; the service gets the rest."""
    out = svc_pb.CreateSessionRequest(
        agent_id=body.agent_id or "",
        environment=_session_environment(body.environment),
        input=_user_messages(body.input),
        metadata=body.metadata or {},
        vault_ids=body.vault_ids or [],
        controls=_controls(body),
    )
    if body.agent is not None:
        config, paths = _agent_config(body.agent)
        out.agent.CopyFrom(config)
        out.agent_mask.paths.extend(paths)
    return out


def _controls(body: SessionCreateBody | SessionUpdateBody) -> s_pb.SessionControls:
    """Review and spend control; the Session service checks what it supports."""
    out = s_pb.SessionControls(review=body.review or "")
    if body.prompt_cache_options is not None:
        out.prompt_cache_ttl = body.prompt_cache_options.ttl or ""
    if body.spend_control is not None and body.spend_control.limit is not None:
        out.spend_limit_cents = body.spend_control.limit
    return out


def update_session_request(session_id: str, body: SessionUpdateBody) -> svc_pb.UpdateSessionRequest:
    check_session_update(body)
    out = svc_pb.UpdateSessionRequest(session_id=session_id, metadata=body.metadata or {})
    paths = ["metadata"] if "metadata" in body.model_fields_set else []
    # A null one resets it (no review, no budget, the model's cache default).
    paths += [name for name in ("review", "spend_control", "prompt_cache_options") if name in body.model_fields_set]
    out.controls.CopyFrom(_controls(body))
    if "vault_ids" in body.model_fields_set:
        paths.append("vault_ids")
        out.vault_ids.extend(body.vault_ids or [])
    if body.agent is not None:
        config, agent_paths = _agent_config(body.agent)
        out.agent.CopyFrom(config)
        paths += [f"agent.{p}" for p in agent_paths]
    out.update_mask.paths.extend(paths)
    return out
