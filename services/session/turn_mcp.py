"""The turn's MCP servers: service-origin HTTP servers this service connects
to itself, and environment-origin ones started or joined in the
environment and reached through the Environment service."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from berth.environment.v1 import environment_pb2
from services.core.errors import BerthError
from services.session.environment_client import EnvironmentClient
from services.session.harness.io import McpClient, McpUnavailable
from services.session.mcp_connections import (
    McpConnections,
    authorization_header,
    environment_transport,
    service_http_transport,
    transport_fingerprint,
)
from services.session.turn_environment import TurnEnvironment

__all__ = ["TurnMcp"]


class TurnMcp:
    """``environment`` and ``client`` are None for a session without one.
    ``vaults`` resolves the credentials of the session's own ``vault_ids``
    for its service-origin servers (None without an Environment service)."""

    def __init__(
        self,
        mcp: McpConnections | None,
        *,
        session_id: str,
        environment: TurnEnvironment | None,
        client: EnvironmentClient | None,
        vaults: EnvironmentClient | None = None,
        vault_ids: list[str] | None = None,
    ) -> None:
        self._mcp = mcp
        self._session_id = session_id
        self._environment = environment
        self._client = client
        self._vaults = vaults
        self._vault_ids = list(vault_ids or [])
        self._environment_lock = asyncio.Lock()

    async def connect(self, tool: dict[str, Any]) -> McpClient:
        label = str(tool["server_label"])
        transport: dict[str, Any] = dict(tool["transport"])
        if self._mcp is None:
            raise McpUnavailable(f"MCP server {label!r} cannot be reached: MCP is not configured in this service")
        # Stdio servers always run in the environment; HTTP ones only when asked to.
        if transport["type"] == "stdio" or tool.get("connection_origin") == "environment":
            return await self._environment_mcp(label, transport, str(tool.get("credential_id") or ""))
        headers = dict(transport.get("headers") or {})
        if transport.get("authorization"):
            headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
            headers["Authorization"] = authorization_header(str(transport["authorization"]))
        url = str(transport["server_url"])
        credential = await self._vault_authorization(label, tool, url)
        if credential:
            headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
            headers["Authorization"] = credential
        timeout_s = self._mcp.call_timeout_s
        # The fingerprint names the credential and the vaults it came from,
        # never its value: a connection opened with a vault the session no
        # longer has is not reused.
        fingerprint = transport_fingerprint(
            "service", "", {**transport, "credential_id": tool.get("credential_id"), "vault_ids": sorted(self._vault_ids)}
        )
        return await self._mcp.connect(
            self._session_id,
            label,
            fingerprint,
            lambda: service_http_transport(url, headers, read_timeout_s=timeout_s),
        )

    async def _vault_authorization(self, label: str, tool: dict[str, Any], url: str) -> str:
        """The Authorization value from the session's vaults for ``url``: the
        tool's ``credential_id``, or the one credential matching the URL."""
        credential_id = str(tool.get("credential_id") or "")
        if self._vaults is None or not (self._vault_ids or credential_id):
            return ""
        try:
            return await self._vaults.resolve_mcp_credential(self._vault_ids, credential_id=credential_id, server_url=url)
        except BerthError as exc:
            raise McpUnavailable(f"MCP server {label!r} has no usable credential: {exc.message}", reason=exc.reason) from exc

    async def _environment_mcp(self, label: str, transport: dict[str, Any], credential_id: str) -> McpClient:
        assert self._mcp is not None
        environment, client = self._environment, self._client
        if environment is None or client is None:
            raise McpUnavailable(f"MCP server {label!r} runs in the environment, and this session has none")
        environment_id = environment.environment_id
        # Servers connect concurrently; the environment's events are emitted once.
        async with self._environment_lock:
            await environment.ensure_ready()
        try:
            server, _ = await client.start_mcp_server(
                environment_id, self._session_id, label, json.dumps(transport), credential_id=credential_id
            )
        except BerthError as exc:
            raise McpUnavailable(f"MCP server {label!r} could not start: {exc.message}", reason=exc.reason) from exc
        if server.state == environment_pb2.MCP_SERVER_STATE_DEAD:
            raise McpUnavailable(f"MCP server {label!r} is dead and is not restarted", reason="MCP_SERVER_DEAD")
        session_id, timeout_s = self._session_id, self._mcp.call_timeout_s

        async def send(message_json: str) -> str:
            return await client.send_mcp_message(environment_id, session_id, label, message_json, timeout_s=timeout_s)

        return await self._mcp.connect(
            self._session_id,
            label,
            transport_fingerprint("environment", environment_id, transport),
            lambda: environment_transport(send, label=label),
        )
