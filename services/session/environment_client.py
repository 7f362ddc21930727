"""The Session service's only path to compute: a typed client of the
Environment service. Failed calls raise the domain error the Environment
service gave (``services.core.errors``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from berth.common.v1 import common_pb2
from berth.environment.v1 import (
    environment_pb2,
    environment_service_pb2,
    environment_service_pb2_grpc,
    vault_service_pb2,
    vault_service_pb2_grpc,
)
from services.core.context import PeerCredentials
from services.core.grpc_server import open_channel

__all__ = ["EnvironmentClient", "SessionOutputs", "process_request"]

_SERVICE = environment_service_pb2.DESCRIPTOR.services_by_name["EnvironmentService"]
_VAULT_SERVICE = vault_service_pb2.DESCRIPTOR.services_by_name["VaultService"]


@dataclass
class SessionOutputs:
    output_dir: str
    entries: list[common_pb2.FileEntry]
    # The environment as read with the session's binding (None when it was
    # not ready then, or from an older Environment service).
    environment: environment_pb2.Environment | None = None


def process_request(
    environment_id: str,
    session_id: str,
    *,
    name: str,
    shell: str,
    cwd: str = "",
    keepalive: bool = False,
    stdin: bool = False,
    by_name: bool = False,
) -> environment_service_pb2.StartProcessRequest:
    """What starts a session's background process, for ``start_process``
    and ``run_process``."""
    return environment_service_pb2.StartProcessRequest(
        environment_id=environment_id,
        session_id=session_id,
        name=name,
        shell=shell,
        cwd=cwd,
        keepalive=keepalive,
        stdin=stdin,
        by_name=by_name,
    )


class EnvironmentClient:
    def __init__(self, address: str, *, credentials: PeerCredentials, timeout_s: float, setup_timeout_s: float) -> None:
        self._channel = open_channel(
            address, timeout_s=timeout_s, credentials=credentials, services=[_SERVICE, _VAULT_SERVICE], domain_errors=True
        )
        self._stub = environment_service_pb2_grpc.EnvironmentServiceStub(self._channel)
        self._vaults = vault_service_pb2_grpc.VaultServiceStub(self._channel)
        self._setup_timeout_s = setup_timeout_s

    async def close(self) -> None:
        await self._channel.close()

    async def create_environment(
        self, config: environment_pb2.EnvironmentConfig, *, vault_ids: list[str], owner_session_id: str
    ) -> environment_pb2.Environment:
        response = await self._stub.CreateEnvironment(
            environment_service_pb2.CreateEnvironmentRequest(
                config=config, vault_ids=vault_ids, owner_session_id=owner_session_id
            )
        )
        return response.environment

    async def check_vaults(self, vault_ids: list[str], *, param: str = "vault_ids") -> None:
        """NotFound (naming ``param``) unless every vault is the caller's."""
        if vault_ids:
            await self._vaults.CheckVaults(vault_service_pb2.CheckVaultsRequest(vault_ids=vault_ids, param=param))

    async def resolve_mcp_credential(self, vault_ids: list[str], *, credential_id: str, server_url: str) -> str:
        """The Authorization header value of a vault credential for
        ``server_url``; empty when none applies. Never log it."""
        response = await self._vaults.ResolveMcpCredential(
            vault_service_pb2.ResolveMcpCredentialRequest(
                vault_ids=vault_ids, credential_id=credential_id, server_url=server_url
            )
        )
        return str(response.authorization)

    async def attach_session(self, environment_id: str, session_id: str) -> environment_pb2.Environment:
        response = await self._stub.AttachSession(
            environment_service_pb2.AttachSessionRequest(environment_id=environment_id, session_id=session_id)
        )
        return response.environment

    async def detach_session(self, environment_id: str, session_id: str) -> bool:
        response = await self._stub.DetachSession(
            environment_service_pb2.DetachSessionRequest(environment_id=environment_id, session_id=session_id)
        )
        return bool(response.environment_deleted)

    async def get_environment(self, environment_id: str) -> environment_pb2.Environment:
        response = await self._stub.GetEnvironment(
            environment_service_pb2.GetEnvironmentRequest(environment_id=environment_id)
        )
        return response.environment

    async def ensure_ready(self, environment_id: str) -> environment_pb2.Environment:
        response = await self._stub.EnsureEnvironmentReady(
            environment_service_pb2.EnsureEnvironmentReadyRequest(environment_id=environment_id),
            timeout=self._setup_timeout_s + 60.0,
        )
        return response.environment

    def exec_command(
        self,
        environment_id: str,
        session_id: str,
        *,
        shell: str,
        cwd: str = "",
        timeout_ms: int = 0,
    ) -> grpc.aio.UnaryStreamCall:
        """The ExecCommand stream; cancelling the call kills the process tree."""
        return self._stub.ExecCommand(
            environment_service_pb2.ExecCommandRequest(
                environment_id=environment_id, session_id=session_id, shell=shell, cwd=cwd, timeout_ms=timeout_ms
            )
        )

    async def start_process(self, start: environment_service_pb2.StartProcessRequest) -> environment_pb2.Process:
        """Starts ``start`` (see ``process_request``)."""
        return (await self._stub.StartProcess(start)).process

    def run_process(self, start: environment_service_pb2.StartProcessRequest) -> grpc.aio.UnaryStreamCall:
        """The RunProcess stream of ``start`` (the process, then its output
        and exit); cancelling the call leaves the process running."""
        return self._stub.RunProcess(environment_service_pb2.RunProcessRequest(start=start))

    async def write_process_stdin(
        self, environment_id: str, process_id: str, data: bytes, *, close: bool = False
    ) -> environment_pb2.Process:
        response = await self._stub.WriteProcessStdin(
            environment_service_pb2.WriteProcessStdinRequest(
                environment_id=environment_id, process_id=process_id, data=data, close=close
            )
        )
        return response.process

    async def remove_file(self, environment_id: str, path: str) -> None:
        await self._stub.RemoveWorkspaceFile(
            environment_service_pb2.RemoveWorkspaceFileRequest(environment_id=environment_id, path=path)
        )

    def attach_process(self, environment_id: str, process_id: str, *, from_seq: int = 0) -> grpc.aio.UnaryStreamCall:
        """The AttachProcess stream; cancelling the call leaves the process running."""
        return self._stub.AttachProcess(
            environment_service_pb2.AttachProcessRequest(
                environment_id=environment_id, process_id=process_id, from_seq=from_seq
            )
        )

    async def kill_process(self, environment_id: str, process_id: str, *, signal: int = 0) -> environment_pb2.Process | None:
        response = await self._stub.KillProcess(
            environment_service_pb2.KillProcessRequest(environment_id=environment_id, process_id=process_id, signal=signal)
        )
        return response.process if response.HasField("process") else None

    async def list_processes(self, environment_id: str) -> list[environment_pb2.Process]:
        response = await self._stub.ListProcesses(
            environment_service_pb2.ListProcessesRequest(environment_id=environment_id)
        )
        return list(response.processes)

    async def read_file_chunks(self, environment_id: str, path: str) -> AsyncIterator[bytes]:
        call = self._stub.ReadWorkspaceFile(
            environment_service_pb2.ReadWorkspaceFileRequest(environment_id=environment_id, path=path)
        )
        async for message in call:
            if message.data:
                yield message.data

    async def read_file(self, environment_id: str, path: str, *, limit: int | None = None) -> tuple[bytes, bool]:
        """Returns (content, truncated)."""
        chunks: list[bytes] = []
        size = 0
        async for chunk in self.read_file_chunks(environment_id, path):
            chunks.append(chunk)
            size += len(chunk)
            if limit is not None and size > limit:
                return b"".join(chunks)[:limit], True
        return b"".join(chunks), False

    async def write_file(self, environment_id: str, path: str, data: bytes) -> common_pb2.FileEntry:
        response = await self._stub.WriteWorkspaceFile(
            environment_service_pb2.WriteWorkspaceFileRequest(environment_id=environment_id, path=path, data=data)
        )
        return response.entry

    async def list_session_outputs(self, environment_id: str, session_id: str) -> SessionOutputs:
        response = await self._stub.ListSessionOutputs(
            environment_service_pb2.ListSessionOutputsRequest(environment_id=environment_id, session_id=session_id)
        )
        environment = response.environment if response.HasField("environment") else None
        return SessionOutputs(output_dir=response.output_dir, entries=list(response.entries), environment=environment)

    async def start_mcp_server(
        self, environment_id: str, session_id: str, label: str, transport_json: str, *, credential_id: str = ""
    ) -> tuple[environment_pb2.McpServer, bool]:
        """Starts or joins the label's environment-origin server; enters the
        init guard first, so it may wait for setup. Its credential comes from
        the environment's vaults."""
        response = await self._stub.StartMcpServer(
            environment_service_pb2.StartMcpServerRequest(
                environment_id=environment_id,
                session_id=session_id,
                label=label,
                transport_json=transport_json,
                credential_id=credential_id,
            ),
            timeout=self._setup_timeout_s + 60.0,
        )
        return response.server, bool(response.created)

    async def send_mcp_message(
        self, environment_id: str, session_id: str, label: str, message_json: str, *, timeout_s: float
    ) -> str:
        response = await self._stub.SendMcpMessage(
            environment_service_pb2.SendMcpMessageRequest(
                environment_id=environment_id, session_id=session_id, label=label, message_json=message_json
            ),
            timeout=timeout_s,
        )
        return str(response.response_json)

    async def list_mcp_servers(self, environment_id: str) -> list[environment_pb2.McpServer]:
        response = await self._stub.ListMcpServers(
            environment_service_pb2.ListMcpServersRequest(environment_id=environment_id)
        )
        return list(response.servers)
