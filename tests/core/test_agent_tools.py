"""One mapping of agent tools: the service stores it with credentials, the
gateway renders it without them."""

from __future__ import annotations

from berth.session.v1 import session_pb2 as pb
from services.core.agent_tools import tool_json


def _http_mcp() -> pb.Tool:
    tool = pb.Tool()
    tool.mcp.server_label = "docs"
    tool.mcp.transport.http.server_url = "https://mcp.example"
    tool.mcp.transport.http.headers["X-Team"] = "a"
    tool.mcp.transport.http.authorization = "Bearer secret"
    return tool


def _stdio_mcp() -> pb.Tool:
    tool = pb.Tool()
    tool.mcp.server_label = "local"
    tool.mcp.transport.stdio.command = "server"
    tool.mcp.transport.stdio.env.values["TOKEN"] = "secret"
    return tool


def test_credentials_are_kept_only_when_asked_for() -> None:
    kept = tool_json(_http_mcp(), headers=True, credentials=True)["transport"]
    assert kept == {"type": "http", "server_url": "https://mcp.example", "headers": {"X-Team": "a"}, "authorization": "Bearer secret"}
    shown = tool_json(_http_mcp(), headers=True, credentials=False)["transport"]
    assert shown == {"type": "http", "server_url": "https://mcp.example", "headers": {"X-Team": "a"}}
    assert "env" in tool_json(_stdio_mcp(), headers=False, credentials=True)["transport"]
    assert "env" not in tool_json(_stdio_mcp(), headers=False, credentials=False)["transport"]


def test_headers_are_left_out_when_not_asked_for() -> None:
    assert tool_json(_http_mcp(), headers=False, credentials=False)["transport"] == {
        "type": "http",
        "server_url": "https://mcp.example",
    }


def test_a_function_tool_renders_its_fields_and_async_only_when_set() -> None:
    tool = pb.Tool(function=pb.FunctionTool(name="lookup", description="d", defer_loading=True))
    tool.function.parameters.update({"type": "object"})
    assert tool_json(tool, headers=False, credentials=False) == {
        "type": "function",
        "name": "lookup",
        "description": "d",
        "parameters": {"type": "object"},
        "defer_loading": True,
    }
    tool.function.run_async = True
    assert tool_json(tool, headers=False, credentials=False)["async"] is True
