"""The one mapping of an agent's tools from the contract (``Tool``) to JSON.

The Session service stores this JSON (with credentials, for the harness) and
the gateway renders it (without them): both read a ``Tool`` field by field
here. What differs is said by the caller: which secrets to keep.
"""

from __future__ import annotations

from typing import Any

from berth.session.v1 import session_pb2 as pb
from services.core.structs import from_struct, from_value

__all__ = ["tool_json"]


def _transport_json(t: pb.McpTransport, *, headers: bool, credentials: bool) -> dict[str, Any]:
    if t.WhichOneof("transport") == "stdio":
        stdio = t.stdio
        out: dict[str, Any] = {
            "type": "stdio",
            "command": stdio.command,
            "cwd": stdio.cwd,
            "args": list(stdio.args),
            "env_vars": list(stdio.env_vars),
        }
        if credentials and stdio.HasField("env"):
            out["env"] = dict(stdio.env.values)
        return out
    http = t.http
    out = {"type": "http", "server_url": http.server_url}
    if headers:
        out["headers"] = dict(http.headers)
    if credentials and http.HasField("authorization"):
        out["authorization"] = http.authorization
    return out


def tool_json(t: pb.Tool, *, headers: bool, credentials: bool) -> dict[str, Any]:
    """``t`` as the Agents API tool object. ``headers`` keeps an HTTP MCP
    server's headers; ``credentials`` keeps its ``authorization`` and a stdio
    server's ``env``. Unset fields are rendered as they are (empty, false or
    null); the service fills in its defaults before storing."""
    kind = t.WhichOneof("tool")
    if kind == "function":
        f = t.function
        out: dict[str, Any] = {
            "type": "function",
            "name": f.name,
            "description": f.description,
            "parameters": from_struct(f.parameters),
            "defer_loading": f.defer_loading,
        }
        if f.HasField("run_async"):
            out["async"] = f.run_async
        return out
    if kind == "mcp":
        m = t.mcp
        return {
            "type": "mcp",
            "server_label": m.server_label,
            "transport": _transport_json(m.transport, headers=headers, credentials=credentials),
            "connection_origin": m.connection_origin,
            "request_metadata": from_struct(m.request_metadata),
            "required": m.required,
            "allowed_tools": list(m.allowed_tools.values) if m.HasField("allowed_tools") else None,
            "credential_id": m.credential_id if m.HasField("credential_id") else None,
        }
    if kind == "web_search":
        w = t.web_search
        return {
            "type": "web_search",
            "allowed_domains": list(w.allowed_domains.values) if w.HasField("allowed_domains") else None,
            "context_size": w.context_size,
            "location": from_value(w.location) if w.HasField("location") else None,
            "mode": w.mode,
        }
    if kind == "computer_use":
        return {"type": "computer_use", "include_screenshots": t.computer_use.include_screenshots}
    if kind == "programmatic_tool_calling":
        return {"type": "programmatic_tool_calling", "enabled": t.programmatic_tool_calling.enabled}
    return {"type": kind}
