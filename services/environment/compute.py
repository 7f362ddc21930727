"""The Environment service's only path to compute: a small typed interface
over the Sandbox service.

``Compute`` is what the domain and the init guard depend on; ``SandboxClient``
implements it with the generated stub, and also ``SandboxInventory``, the
cross-organization view the sandbox reconciler needs. Failed calls surface
as domain errors: an unreachable Sandbox service is ``SandboxUnavailable``
(the domain adds the environment and session IDs), anything else keeps the
reason the Sandbox service gave it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeAlias

import grpc

from berth.common.v1 import common_pb2
from berth.sandbox.v1 import sandbox_pb2, sandbox_service_pb2, sandbox_service_pb2_grpc
from services.core.context import org_metadata
from services.core.errors import BerthError, SandboxUnavailable, from_rpc_error

__all__ = [
    "Compute",
    "SandboxSpec",
    "ExecEvent",
    "SandboxClient",
    "SandboxInventory",
    "EnvironmentSandbox",
    "ENVIRONMENT_LABEL",
    "SANDBOX_IDEMPOTENT_METHODS",
]

ExecEvent: TypeAlias = common_pb2.OutputChunk | common_pb2.ExitStatus

_SERVICE = "berth.sandbox.v1.SandboxService"

# Safe to retry on UNAVAILABLE: reads, and writes that are idempotent by ID
# or replace a whole file.
SANDBOX_IDEMPOTENT_METHODS: tuple[tuple[str, str], ...] = tuple(
    (_SERVICE, m)
    for m in (
        "CreateSandbox",
        "GetSandbox",
        "ListLabeledSandboxes",
        "ListFiles",
        "ReadFile",
        "WriteFile",
        "DestroySandbox",
        "ListMcpBrokers",
    )
)

# The label naming the environment a sandbox belongs to.
ENVIRONMENT_LABEL = "berth.environment_id"
# The cross-organization listing is not scoped by organization, yet every RPC
# must name one; this one says in the Sandbox service's logs who is asking.
_INVENTORY_ORG = "berth.environment-reconciler"
_INVENTORY_PAGE_SIZE = 1000

_SIZES: Mapping[str, int] = {
    "": sandbox_pb2.CONTAINER_SIZE_UNSPECIFIED,
    "small": sandbox_pb2.CONTAINER_SIZE_SMALL,
    "medium": sandbox_pb2.CONTAINER_SIZE_MEDIUM,
    "large": sandbox_pb2.CONTAINER_SIZE_LARGE,
}


@dataclass(frozen=True)
class SandboxSpec:
    """What CreateSandbox needs for one environment."""

    sandbox_id: str
    labels: Mapping[str, str] = field(default_factory=dict)
    network: common_pb2.NetworkPolicy = field(default_factory=common_pb2.NetworkPolicy)
    env: Mapping[str, str] = field(default_factory=dict)
    container_size: str = ""


class Compute(Protocol):
    """Sandbox operations used by the Environment service."""

    async def create_sandbox(self, spec: SandboxSpec) -> None: ...

    async def destroy_sandbox(self, sandbox_id: str) -> None: ...

    def exec(
        self,
        sandbox_id: str,
        *,
        argv: Sequence[str] = (),
        shell: str = "",
        cwd: str = "",
        env: Mapping[str, str] | None = None,
        timeout_ms: int = 0,
    ) -> AsyncIterator[ExecEvent]:
        """Output chunks, then exactly one ExitStatus. Closing the iterator
        early (or cancelling its consumer) cancels the command."""
        ...

    async def write_file(self, sandbox_id: str, path: str, data: bytes, *, mode: int = 0) -> common_pb2.FileEntry: ...

    def read_file(self, sandbox_id: str, path: str) -> AsyncIterator[tuple[bytes, int]]:
        """(chunk, total size) pairs; the size is set on the first chunk."""
        ...

    async def list_files(self, sandbox_id: str, path: str, *, recursive: bool) -> list[common_pb2.FileEntry]: ...

    async def start_mcp_broker(
        self, sandbox_id: str, label: str, transport: sandbox_pb2.McpTransport
    ) -> tuple[sandbox_pb2.McpBroker, bool]:
        """The label's broker and whether this call created it with ``transport``."""
        ...

    async def list_mcp_brokers(self, sandbox_id: str) -> list[sandbox_pb2.McpBroker]: ...

    async def send_mcp_message(self, sandbox_id: str, label: str, message_json: str, *, timeout_s: float) -> str:
        """The JSON-RPC response to a request; empty for anything else."""
        ...

    async def stop_mcp_broker(self, sandbox_id: str, label: str, *, timeout_s: float) -> sandbox_pb2.McpBroker: ...

    async def close_mcp_upstream(self, sandbox_id: str, label: str, *, timeout_s: float) -> bool: ...


@dataclass(frozen=True)
class EnvironmentSandbox:
    """A sandbox that carries an environment label, as the Sandbox service
    lists it; ``created_at`` is by the Sandbox service's clock."""

    sandbox_id: str
    org_id: str
    environment_id: str
    created_at: float


class SandboxInventory(Protocol):
    """Every organization's environment sandboxes, for the reconciler."""

    async def list_environment_sandboxes(self) -> list[EnvironmentSandbox]:
        """Every sandbox that carries ``ENVIRONMENT_LABEL`` and is not destroyed."""
        ...

    async def destroy_org_sandbox(self, org_id: str, sandbox_id: str) -> None:
        """Destroys one organization's sandbox; a sandbox that is gone already is fine."""
        ...


def _translate(exc: grpc.aio.AioRpcError, sandbox_id: str) -> BerthError:
    if exc.code() == grpc.StatusCode.UNAVAILABLE:
        return SandboxUnavailable(f"sandbox {sandbox_id} is unavailable: {exc.details() or 'unreachable'}")
    return from_rpc_error(exc)


class SandboxClient:
    """``Compute`` and ``SandboxInventory`` over the Sandbox service's gRPC API."""

    def __init__(self, channel: grpc.aio.Channel, *, create_timeout_s: float) -> None:
        self._stub = sandbox_service_pb2_grpc.SandboxServiceStub(channel)
        self._create_timeout_s = create_timeout_s

    async def create_sandbox(self, spec: SandboxSpec) -> None:
        request = sandbox_service_pb2.CreateSandboxRequest(
            sandbox_id=spec.sandbox_id,
            labels=dict(spec.labels),
            network=spec.network,
            env=dict(spec.env),
            size=_SIZES.get(spec.container_size, sandbox_pb2.CONTAINER_SIZE_UNSPECIFIED),
        )
        try:
            await self._stub.CreateSandbox(request, timeout=self._create_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise _translate(exc, spec.sandbox_id) from exc

    async def destroy_sandbox(self, sandbox_id: str) -> None:
        await self._destroy(sandbox_id, metadata=None)

    async def destroy_org_sandbox(self, org_id: str, sandbox_id: str) -> None:
        await self._destroy(sandbox_id, metadata=org_metadata(org_id))

    async def _destroy(self, sandbox_id: str, *, metadata: tuple[tuple[str, str], ...] | None) -> None:
        try:
            await self._stub.DestroySandbox(sandbox_service_pb2.DestroySandboxRequest(sandbox_id=sandbox_id), metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return
            raise _translate(exc, sandbox_id) from exc

    async def list_environment_sandboxes(self) -> list[EnvironmentSandbox]:
        found: list[EnvironmentSandbox] = []
        token = ""
        while True:
            request = sandbox_service_pb2.ListLabeledSandboxesRequest(
                label_key=ENVIRONMENT_LABEL, page_size=_INVENTORY_PAGE_SIZE, page_token=token
            )
            try:
                response = await self._stub.ListLabeledSandboxes(request, metadata=org_metadata(_INVENTORY_ORG))
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    raise SandboxUnavailable(f"the Sandbox service is unavailable: {exc.details() or 'unreachable'}") from exc
                raise from_rpc_error(exc) from exc
            found.extend(
                EnvironmentSandbox(
                    sandbox_id=s.sandbox_id,
                    org_id=s.org_id,
                    environment_id=s.label_value,
                    created_at=s.create_time.ToNanoseconds() / 1e9,
                )
                for s in response.sandboxes
            )
            token = response.next_page_token
            if not token:
                return found

    async def exec(
        self,
        sandbox_id: str,
        *,
        argv: Sequence[str] = (),
        shell: str = "",
        cwd: str = "",
        env: Mapping[str, str] | None = None,
        timeout_ms: int = 0,
    ) -> AsyncIterator[ExecEvent]:
        request = sandbox_service_pb2.ExecRequest(
            sandbox_id=sandbox_id, argv=list(argv), shell=shell, cwd=cwd, env=dict(env or {}), timeout_ms=timeout_ms
        )
        call = self._stub.Exec(request)
        try:
            async for response in call:
                if response.HasField("chunk"):
                    yield response.chunk
                elif response.HasField("exit"):
                    yield response.exit
        except grpc.aio.AioRpcError as exc:
            raise _translate(exc, sandbox_id) from exc
        finally:
            # Reached on cancellation or early close as well: cancelling the
            # call makes the Sandbox service kill the command's process tree.
            call.cancel()

    async def write_file(self, sandbox_id: str, path: str, data: bytes, *, mode: int = 0) -> common_pb2.FileEntry:
        request = sandbox_service_pb2.WriteFileRequest(sandbox_id=sandbox_id, path=path, data=data, mode=mode)
        try:
            response = await self._stub.WriteFile(request)
        except grpc.aio.AioRpcError as exc:
            raise _translate(exc, sandbox_id) from exc
        return response.entry

    async def read_file(self, sandbox_id: str, path: str) -> AsyncIterator[tuple[bytes, int]]:
        call = self._stub.ReadFile(sandbox_service_pb2.ReadFileRequest(sandbox_id=sandbox_id, path=path))
        try:
            async for response in call:
                yield response.data, response.size_bytes
        except grpc.aio.AioRpcError as exc:
            raise _translate(exc, sandbox_id) from exc
        finally:
            call.cancel()

    async def list_files(self, sandbox_id: str, path: str, *, recursive: bool) -> list[common_pb2.FileEntry]:
        request = sandbox_service_pb2.ListFilesRequest(sandbox_id=sandbox_id, path=path, recursive=recursive)
        try:
            response = await self._stub.ListFiles(request)
        except grpc.aio.AioRpcError as exc:
            raise _translate(exc, sandbox_id) from exc
        return list(response.entries)

    async def start_mcp_broker(
        self, sandbox_id: str, label: str, transport: sandbox_pb2.McpTransport
    ) -> tuple[sandbox_pb2.McpBroker, bool]:
        request = sandbox_service_pb2.StartMcpBrokerRequest(sandbox_id=sandbox_id, label=label, transport=transport)
        try:
            response = await self._stub.StartMcpBroker(request)
        except grpc.aio.AioRpcError as exc:
            raise _translate(exc, sandbox_id) from exc
        return response.broker, bool(response.created)

    async def list_mcp_brokers(self, sandbox_id: str) -> list[sandbox_pb2.McpBroker]:
        try:
            response = await self._stub.ListMcpBrokers(sandbox_service_pb2.ListMcpBrokersRequest(sandbox_id=sandbox_id))
        except grpc.aio.AioRpcError as exc:
            raise _translate(exc, sandbox_id) from exc
        return list(response.brokers)

    async def send_mcp_message(self, sandbox_id: str, label: str, message_json: str, *, timeout_s: float) -> str:
        request = sandbox_service_pb2.SendMcpMessageRequest(sandbox_id=sandbox_id, label=label, message_json=message_json)
        try:
            response = await self._stub.SendMcpMessage(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise _translate(exc, sandbox_id) from exc
        return str(response.message_json)

    async def stop_mcp_broker(self, sandbox_id: str, label: str, *, timeout_s: float) -> sandbox_pb2.McpBroker:
        request = sandbox_service_pb2.StopMcpBrokerRequest(sandbox_id=sandbox_id, label=label)
        try:
            response = await self._stub.StopMcpBroker(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise _translate(exc, sandbox_id) from exc
        return response.broker

    async def close_mcp_upstream(self, sandbox_id: str, label: str, *, timeout_s: float) -> bool:
        request = sandbox_service_pb2.CloseMcpUpstreamRequest(sandbox_id=sandbox_id, label=label)
        try:
            response = await self._stub.CloseMcpUpstream(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise _translate(exc, sandbox_id) from exc
        return bool(response.closed)
