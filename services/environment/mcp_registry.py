"""Environment-origin MCP servers: the configuration the Agents API sends,
translated for the sandbox's brokers, and the registry view of a label.

The registry answers "who started this label's server, with what kind of
transport, and which sessions use it"; whether the server is alive is the
sandbox broker's state, read on demand. See ``EnvironmentDomain`` for the
binding rules (first configuration wins, dead servers stay dead).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from berth.sandbox.v1 import sandbox_pb2
from services.core.errors import InvalidArgument
from services.environment.models import MCP_ORIGIN_ENVIRONMENT, McpServerRow, McpServerUseRow

__all__ = [
    "McpServerInfo",
    "parse_transport",
    "validate_label",
    "transport_name",
    "authorization_header",
    "merge_servers",
    "MAX_LABEL",
]

MAX_LABEL = 128

_TRANSPORT_NAMES = {
    sandbox_pb2.MCP_TRANSPORT_TYPE_STDIO: "stdio",
    sandbox_pb2.MCP_TRANSPORT_TYPE_HTTP: "http",
}
_STATE_NAMES = {
    sandbox_pb2.MCP_BROKER_STATE_RUNNING: "running",
    sandbox_pb2.MCP_BROKER_STATE_DEAD: "dead",
}


@dataclass(frozen=True)
class McpServerInfo:
    """One label as ``ListMcpServers`` reports it. ``state`` is "running",
    "dead", or "" when the sandbox reports no broker for the label."""

    environment_id: str
    label: str
    transport_type: str
    owner_session_id: str
    state: str
    create_time: float
    session_ids: list[str] = field(default_factory=list)
    pid: int = 0
    origin: str = MCP_ORIGIN_ENVIRONMENT


def transport_name(value: int) -> str:
    return _TRANSPORT_NAMES.get(value, "")


def validate_label(label: str) -> str:
    if not 0 < len(label) <= MAX_LABEL or any(c.isspace() or not c.isprintable() for c in label):
        raise InvalidArgument(f"label must be 1-{MAX_LABEL} printable characters without spaces", param="label")
    return label


def authorization_header(value: str) -> str:
    """The ``authorization`` of an MCP transport is a token; a value that
    already names its scheme ("Basic ...") is sent as given."""
    value = value.strip()
    return value if " " in value else f"Bearer {value}"


def _fail(param: str, message: str) -> InvalidArgument:
    return InvalidArgument(message, param=f"transport_json.{param}" if param else "transport_json")


def _str(data: Mapping[str, Any], key: str, *, required: bool = False) -> str:
    value = data.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value):
        raise _fail(key, f"{key} must be a non-empty string" if required else f"{key} must be a string")
    return value


def _str_list(data: Mapping[str, Any], key: str) -> list[str]:
    value = data.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _fail(key, f"{key} must be a list of strings")
    return list(value)


def _str_map(data: Mapping[str, Any], key: str) -> dict[str, str]:
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise _fail(key, f"{key} must map strings to strings")
    return dict(value)


def parse_transport(transport_json: str) -> sandbox_pb2.McpTransport:
    """The Agents API's MCP transport (``McpTransportParam``) as the
    sandbox's broker configuration. An http ``authorization`` becomes the
    ``Authorization`` header, replacing one given in ``headers``."""
    try:
        data = json.loads(transport_json)
    except ValueError:
        raise _fail("", "transport_json is not valid JSON") from None
    if not isinstance(data, dict):
        raise _fail("", "transport_json must be an object")
    kind = data.get("type")
    if kind == "stdio":
        return sandbox_pb2.McpTransport(
            stdio=sandbox_pb2.McpStdioTransport(
                command=_str(data, "command", required=True),
                args=_str_list(data, "args"),
                cwd=_str(data, "cwd"),
                env=_str_map(data, "env"),
                env_vars=_str_list(data, "env_vars"),
            )
        )
    if kind == "http":
        url = _str(data, "server_url", required=True)
        if not url.startswith(("http://", "https://")):
            raise _fail("server_url", "server_url must be an http or https URL")
        headers = _str_map(data, "headers")
        authorization = _str(data, "authorization")
        if authorization:
            headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
            headers["Authorization"] = authorization_header(authorization)
        return sandbox_pb2.McpTransport(http=sandbox_pb2.McpHttpTransport(server_url=url, headers=headers))
    raise _fail("type", "type must be stdio or http")


def merge_servers(
    environment_id: str,
    rows: Sequence[McpServerRow],
    uses: Sequence[McpServerUseRow],
    brokers: Sequence[sandbox_pb2.McpBroker],
) -> list[McpServerInfo]:
    """Registry rows with their broker's live state, plus brokers the
    registry missed (a start whose registration did not complete)."""
    by_label = {b.label: b for b in brokers}
    sessions: dict[str, list[str]] = {}
    for use in uses:
        sessions.setdefault(use.label, []).append(use.session_id)
    out: list[McpServerInfo] = []
    for row in rows:
        broker = by_label.pop(row.label, None)
        out.append(
            McpServerInfo(
                environment_id=environment_id,
                label=row.label,
                transport_type=row.transport_type,
                owner_session_id=row.owner_session_id,
                state=_STATE_NAMES.get(broker.state, "") if broker is not None else "",
                create_time=row.create_time,
                session_ids=sessions.get(row.label, []),
                pid=int(broker.pid) if broker is not None else 0,
            )
        )
    for broker in by_label.values():
        out.append(
            McpServerInfo(
                environment_id=environment_id,
                label=broker.label,
                transport_type=transport_name(broker.transport_type),
                owner_session_id="",
                state=_STATE_NAMES.get(broker.state, ""),
                create_time=broker.start_time.ToNanoseconds() / 1e9,
                session_ids=sessions.get(broker.label, []),
                pid=int(broker.pid),
            )
        )
    return out
