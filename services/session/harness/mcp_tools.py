"""MCP tools in the agent loop.

Every ``mcp`` tool of the agent snapshot is connected before the turn's first
model call, so its tools can be offered. The model sees them as
``<server_label>.<tool>``, limited to ``allowed_tools`` when that is set. A
``required`` server that cannot be initialized fails the turn with
``mcp_server_error``; any other unavailable server just offers no tools, and
a call to it fails as an ``mcp_call`` item.

Each call is an ``mcp_call`` item (``server_label``, ``name``,
``arguments``, ``output``, ``error``, ``status``), added when the call starts
and finished with its outcome. The calls of one model response run
concurrently.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import mcp_types

from services.core.logging import get_logger
from services.session.agents import AgentConfig
from services.session.harness.io import ItemHandle, McpClient, McpUnavailable, TurnFailure, TurnIO
from services.session.harness.models.base import ToolCall, ToolSpec

__all__ = ["McpToolbox", "mcp_tool_configs", "is_mcp_call", "MCP_SERVER_ERROR", "render_result"]

log = get_logger(__name__)

MCP_SERVER_ERROR = "mcp_server_error"
_MAX_ITEM_TEXT = 256 * 1024
_MAX_MODEL_TEXT = 16 * 1024


def mcp_tool_configs(config: AgentConfig) -> list[dict[str, Any]]:
    return [t for t in config.get("tools", []) if t.get("type") == "mcp"]


def is_mcp_call(name: str) -> bool:
    """Function and environment tool names have no dots; MCP tools do."""
    return "." in name


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n...[{len(text) - limit} characters omitted]...\n{text[-half:]}"


def render_result(result: mcp_types.CallToolResult) -> tuple[Any, str]:
    """(item output, what the model reads). Text content is the output;
    a result with only structured content outputs that object."""
    texts: list[str] = []
    for block in result.content:
        if isinstance(block, mcp_types.TextContent):
            texts.append(block.text)
        elif isinstance(block, mcp_types.EmbeddedResource) and isinstance(block.resource, mcp_types.TextResourceContents):
            texts.append(block.resource.text)
        elif isinstance(block, mcp_types.ResourceLink):
            texts.append(f"[resource {block.uri}]")
        else:
            texts.append(f"[{block.type}]")
    if texts:
        text = "\n".join(texts)
        return _clip(text, _MAX_ITEM_TEXT), _clip(text, _MAX_MODEL_TEXT)
    if result.structured_content is not None:
        return result.structured_content, _clip(json.dumps(result.structured_content), _MAX_MODEL_TEXT)
    return "", ""


@dataclass
class _Server:
    label: str
    client: McpClient | None
    allowed: list[str] | None
    problem: str = ""
    tools: dict[str, mcp_types.Tool] = field(default_factory=dict)


@dataclass
class _Started:
    call: ToolCall
    handle: ItemHandle
    item: dict[str, Any]
    client: McpClient
    arguments: dict[str, Any]


def _call_entries(call: ToolCall, output: str) -> list[dict[str, Any]]:
    return [
        {"role": "assistant", "tool_calls": [call.as_entry()]},
        {"role": "tool", "call_id": call.id, "output": output},
    ]


class McpToolbox:
    """The MCP servers of one turn. ``prepare`` runs before each model call
    and reconnects only when the agent's MCP configuration changed."""

    def __init__(self) -> None:
        self._servers: dict[str, _Server] = {}
        self._key: str | None = None

    async def prepare(self, io: TurnIO, config: AgentConfig) -> None:
        configs = mcp_tool_configs(config)
        key = json.dumps(configs, sort_keys=True)
        if key == self._key:
            return
        # Every connection attempt ends before a failure is raised, so none
        # is left running behind a failed turn.
        outcomes = await asyncio.gather(*(self._connect(io, tool) for tool in configs), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        self._servers = {s.label: s for s in outcomes if isinstance(s, _Server)}
        self._key = key

    async def _connect(self, io: TurnIO, tool: dict[str, Any]) -> _Server:
        label = str(tool["server_label"])
        allowed = tool.get("allowed_tools")
        try:
            client = await io.mcp_connect(tool)
        except McpUnavailable as exc:
            if tool.get("required"):
                raise TurnFailure(MCP_SERVER_ERROR, f"required MCP server {label!r} failed to initialize: {exc.message}") from exc
            log.warning("mcp_server_unavailable", session_id=io.session_id, label=label, reason=exc.reason, error=exc.message)
            return _Server(label, None, allowed, problem=exc.message)
        tools = {t.name: t for t in client.tools if allowed is None or t.name in allowed}
        return _Server(label, client, allowed, tools=tools)

    def specs(self) -> list[ToolSpec]:
        specs: list[ToolSpec] = []
        for server in self._servers.values():
            for tool in server.tools.values():
                schema = dict(tool.input_schema) if tool.input_schema else {"type": "object", "properties": {}}
                specs.append(ToolSpec(f"{server.label}.{tool.name}", tool.description or tool.title or "", schema))
        return specs

    def _resolve(self, name: str) -> tuple[str, str]:
        """Splits ``label.tool`` at the longest configured label (labels may
        contain dots), else at the first dot."""
        for label in sorted(self._servers, key=len, reverse=True):
            if name.startswith(label + "."):
                return label, name[len(label) + 1 :]
        label, _, tool = name.partition(".")
        return label, tool

    async def run(self, io: TurnIO, calls: list[ToolCall]) -> None:
        """Runs the MCP calls of one model response: items are added in the
        response's order, then the calls proceed concurrently."""
        started = [s for s in [await self._start(io, call) for call in calls] if s is not None]
        if started:
            await asyncio.gather(*(self._finish(io, s) for s in started))

    async def _start(self, io: TurnIO, call: ToolCall) -> _Started | None:
        label, tool = self._resolve(call.name)
        try:
            parsed = json.loads(call.arguments or "{}")
        except ValueError:
            parsed = None
        arguments = parsed if isinstance(parsed, dict) else None
        item: dict[str, Any] = {
            "type": "mcp_call",
            "server_label": label,
            "name": tool,
            "arguments": arguments if arguments is not None else call.arguments,
            "output": None,
            "error": None,
            "status": "in_progress",
        }
        server = self._servers.get(label)
        if server is None:
            problem = f"no MCP server labelled {label!r} is configured"
        elif server.client is None:
            problem = f"MCP server {label!r} is unavailable: {server.problem}"
        elif tool not in server.tools:
            allowed = server.allowed is not None and tool not in server.allowed
            problem = f"tool {tool!r} is {'not allowed' if allowed else 'not offered'} on MCP server {label!r}"
        elif arguments is None:
            problem = f"arguments for {call.name} must be a JSON object"
        else:
            problem = ""
        if problem or server is None or server.client is None or arguments is None:
            failed = {**item, "status": "failed", "error": problem}
            await io.add_item(failed, entries=_call_entries(call, f"error: {problem}"), output=True, done=True)
            return None
        handle = await io.add_item(item, entries=[], output=True, done=False)
        io.track_item(handle, item)
        return _Started(call, handle, item, server.client, arguments)

    async def _finish(self, io: TurnIO, started: _Started) -> None:
        item = dict(started.item)
        try:
            result = await started.client.call_tool(str(item["name"]), started.arguments)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure of the call is the call's outcome, not the turn's
            message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
            item.update(status="failed", error=message)
            model_text = f"error: {message}"
        else:
            output, model_text = render_result(result)
            if result.is_error:
                item.update(status="failed", error=output if isinstance(output, str) and output else "the tool reported an error")
                model_text = f"error: {model_text}"
            else:
                item.update(status="completed", output=output)
        io.track_item(started.handle, item)
        await io.finish_item(started.handle, item, entries=_call_entries(started.call, model_text))
