"""The Environment service's only path to compute: a small typed interface
over the Sandbox service nodes.

``Compute`` is what the domain and the init guard depend on. It addresses a
sandbox by ``SandboxRef``, its ID and the node its environment's row
records, and places new sandboxes on a node; ``SandboxInventory`` is the
cross-organization view, node by node, that the sandbox reconciler needs.
``SandboxNodes`` (sandbox_nodes.py) implements both over one
``SandboxClient`` per node, which wraps the generated stub. Failed calls
surface as domain errors: an unreachable node is ``SandboxUnavailable`` (the
domain adds the environment and session IDs), anything else keeps the
reason the Sandbox service gave it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeAlias

import grpc

from berth.common.v1 import common_pb2
from berth.sandbox.v1 import sandbox_pb2, sandbox_service_pb2, sandbox_service_pb2_grpc
from services.core.context import PeerCredentials, org_metadata
from services.core.errors import NotFound, SandboxUnavailable, Unavailable
from services.core.grpc_server import open_channel

__all__ = [
    "Compute",
    "SandboxRef",
    "SandboxSpec",
    "ExecEvent",
    "ProcessStart",
    "SandboxClient",
    "SandboxInventory",
    "EnvironmentSandbox",
    "ENVIRONMENT_LABEL",
    "SANDBOX_SERVICE",
    "open_sandbox_channel",
]

ExecEvent: TypeAlias = common_pb2.OutputChunk | common_pb2.ExitStatus

SANDBOX_SERVICE = sandbox_service_pb2.DESCRIPTOR.services_by_name["SandboxService"]

# The label naming the environment a sandbox belongs to.
ENVIRONMENT_LABEL = "berth.environment_id"
# The cross-organization listing and count are not scoped by organization, yet
# every RPC must name one; these say in the Sandbox service's logs who is asking.
_INVENTORY_ORG = "berth.environment-reconciler"
_PLACEMENT_ORG = "berth.environment-placement"
_INVENTORY_PAGE_SIZE = 1000
# Sandbox states whose workspace and processes are still there.
_ALIVE = (sandbox_pb2.SANDBOX_STATE_RUNNING, sandbox_pb2.SANDBOX_STATE_PAUSED)

_SIZES: Mapping[str, int] = {
    "": sandbox_pb2.CONTAINER_SIZE_UNSPECIFIED,
    "small": sandbox_pb2.CONTAINER_SIZE_SMALL,
    "medium": sandbox_pb2.CONTAINER_SIZE_MEDIUM,
    "large": sandbox_pb2.CONTAINER_SIZE_LARGE,
}


@dataclass(frozen=True)
class SandboxRef:
    """An environment's sandbox: its ID, and the node its environment's row
    records (empty is the default node, the first configured)."""

    sandbox_id: str
    node: str


@dataclass(frozen=True)
class SandboxSpec:
    """What CreateSandbox needs for one environment, besides its identity."""

    labels: Mapping[str, str] = field(default_factory=dict)
    network: common_pb2.NetworkPolicy = field(default_factory=common_pb2.NetworkPolicy)
    env: Mapping[str, str] = field(default_factory=dict)
    container_size: str = ""
    # environment_variable credentials; secret values, so never in a repr.
    secret_substitutions: Sequence[sandbox_pb2.SecretSubstitution] = field(default=(), repr=False)


@dataclass(frozen=True)
class ProcessStart:
    """What starts a background process in a sandbox: a StartProcessRequest
    but for the sandbox. With ``stdin`` its stdin is a pipe for
    ``write_process_stdin``; with ``by_name`` a process of that name that
    exists is returned instead of a new one."""

    name: str
    argv: Sequence[str] = ()
    shell: str = ""
    cwd: str = ""
    # The command's variables; they may hold secrets, so never in a repr.
    env: Mapping[str, str] = field(default_factory=dict, repr=False)
    keepalive: bool = False
    stdin: bool = False
    by_name: bool = False

    def request(self, sandbox_id: str) -> sandbox_service_pb2.StartProcessRequest:
        return sandbox_service_pb2.StartProcessRequest(
            sandbox_id=sandbox_id,
            name=self.name,
            argv=list(self.argv),
            shell=self.shell,
            cwd=self.cwd,
            env=dict(self.env),
            keepalive=self.keepalive,
            stdin=self.stdin,
            by_name=self.by_name,
        )


class Compute(Protocol):
    """Sandbox operations used by the Environment service; each goes to the
    node the ``SandboxRef`` names."""

    async def place_sandbox(self, previous_node: str | None) -> str:
        """The node a new sandbox goes to: among the nodes that answer, the
        one with the fewest live sandboxes, the first configured on a tie.
        ``previous_node`` is the node an earlier attempt of the same setup
        recorded; it is kept while it answers, so a retry finds what it made
        there. No node answering is ``SandboxUnavailable``."""
        ...

    async def create_sandbox(self, sandbox: SandboxRef, spec: SandboxSpec) -> None: ...

    async def destroy_sandbox(self, sandbox: SandboxRef) -> None: ...

    async def update_secret_substitutions(
        self, sandbox: SandboxRef, substitutions: Sequence[sandbox_pb2.SecretSubstitution]
    ) -> bool:
        """Replaces the secrets the sandbox's egress proxy substitutes (see
        ``UpdateSecretSubstitutions``); False when the sandbox does not
        exist (any more, or yet). An unreachable node is ``SandboxUnavailable``."""
        ...

    async def sandbox_alive(self, sandbox: SandboxRef) -> bool:
        """Whether the sandbox exists and runs (or is paused): what a setup
        taking over from another owner may keep using. An unreachable node
        is ``SandboxUnavailable``."""
        ...

    def exec(
        self,
        sandbox: SandboxRef,
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

    async def write_file(self, sandbox: SandboxRef, path: str, data: bytes, *, mode: int = 0) -> common_pb2.FileEntry: ...

    def read_file(self, sandbox: SandboxRef, path: str) -> AsyncIterator[tuple[bytes, int]]:
        """(chunk, total size) pairs; the size is set on the first chunk."""
        ...

    async def list_files(self, sandbox: SandboxRef, path: str, *, recursive: bool) -> list[common_pb2.FileEntry]: ...

    async def start_mcp_broker(
        self, sandbox: SandboxRef, label: str, transport: sandbox_pb2.McpTransport
    ) -> tuple[sandbox_pb2.McpBroker, bool]:
        """The label's broker and whether this call created it with ``transport``."""
        ...

    async def start_process(self, sandbox: SandboxRef, start: ProcessStart) -> sandbox_pb2.Process:
        """Starts a background process that outlives the call."""
        ...

    def attach_process(self, sandbox: SandboxRef, process_id: str, *, from_seq: int = 0) -> AsyncIterator[ExecEvent]:
        """The process's output chunks from ``from_seq``, then its ExitStatus
        once it has exited. Closing the iterator leaves the process running."""
        ...

    def run_process(self, sandbox: SandboxRef, start: ProcessStart) -> AsyncIterator[sandbox_pb2.Process | ExecEvent]:
        """``start_process``, then ``attach_process`` from its first chunk, in
        one sandbox call: the Process first, then its events. Closing the
        iterator leaves the process running."""
        ...

    async def kill_process(self, sandbox: SandboxRef, process_id: str, *, signal: int = 0) -> sandbox_pb2.Process | None:
        """Signals the process tree (0 is SIGKILL); None when the sandbox no longer knows it."""
        ...

    async def list_processes(self, sandbox: SandboxRef) -> list[sandbox_pb2.Process]: ...

    async def write_process_stdin(
        self, sandbox: SandboxRef, process_id: str, data: bytes, *, close: bool
    ) -> sandbox_pb2.Process:
        """Writes to the stdin of a process started with ``stdin``; ``close`` then closes it."""
        ...

    async def remove_file(self, sandbox: SandboxRef, path: str) -> None:
        """Removes a file or an empty directory; a symlink itself, not its target."""
        ...

    async def make_directory(self, sandbox: SandboxRef, path: str) -> None:
        """Makes a directory and its missing parents (``mkdir -p``, without a process)."""
        ...

    async def list_mcp_brokers(self, sandbox: SandboxRef) -> list[sandbox_pb2.McpBroker]: ...

    async def send_mcp_message(self, sandbox: SandboxRef, label: str, message_json: str, *, timeout_s: float) -> str:
        """The JSON-RPC response to a request; empty for anything else."""
        ...

    async def stop_mcp_broker(self, sandbox: SandboxRef, label: str, *, timeout_s: float) -> sandbox_pb2.McpBroker: ...

    async def close_mcp_upstream(self, sandbox: SandboxRef, label: str, *, timeout_s: float) -> bool: ...


@dataclass(frozen=True)
class EnvironmentSandbox:
    """A sandbox that carries an environment label, as the node it lives on
    lists it; ``created_at`` is by that Sandbox service's clock."""

    sandbox_id: str
    org_id: str
    environment_id: str
    created_at: float
    node: str = ""


class SandboxInventory(Protocol):
    """Every organization's environment sandboxes, node by node, for the reconciler."""

    def node_names(self) -> Sequence[str]:
        """The configured nodes, the default node first."""
        ...

    async def list_environment_sandboxes(self, node: str) -> list[EnvironmentSandbox]:
        """Every sandbox on ``node`` that carries ``ENVIRONMENT_LABEL`` and is not destroyed."""
        ...

    async def destroy_org_sandbox(self, org_id: str, sandbox: SandboxRef) -> None:
        """Destroys one organization's sandbox; a sandbox that is gone already is fine."""
        ...


def open_sandbox_channel(address: str, *, timeout_s: float, credentials: PeerCredentials) -> grpc.aio.Channel:
    """A channel to one Sandbox service node, as ``SandboxClient`` needs it:
    failed calls raise domain errors, and the methods the proto marks
    idempotent are retried on UNAVAILABLE."""
    return open_channel(address, timeout_s=timeout_s, credentials=credentials, services=[SANDBOX_SERVICE], domain_errors=True)


class SandboxClient:
    """One Sandbox service node over its gRPC API, addressed by sandbox ID.
    Its channel comes from ``open_sandbox_channel``."""

    def __init__(self, channel: grpc.aio.Channel, *, create_timeout_s: float, node: str = "") -> None:
        self._stub = sandbox_service_pb2_grpc.SandboxServiceStub(channel)
        self._create_timeout_s = create_timeout_s
        self.node = node

    def _where(self) -> str:
        return f"sandbox node {self.node}" if self.node else "the Sandbox service"

    @contextlib.contextmanager
    def _unreachable(self, sandbox_id: str = "") -> Iterator[None]:
        """An UNAVAILABLE call names the sandbox, or the node, that did not
        answer; every other error keeps the reason the Sandbox service gave it."""
        try:
            yield
        except Unavailable as exc:
            if exc.received_code != grpc.StatusCode.UNAVAILABLE:
                raise
            detail = exc.message or "unreachable"
            if not sandbox_id:
                raise SandboxUnavailable(f"{self._where()} is unavailable: {detail}") from exc
            where = f" on sandbox node {self.node}" if self.node else ""
            raise SandboxUnavailable(f"sandbox {sandbox_id}{where} is unavailable: {detail}") from exc

    async def count_live_sandboxes(self, *, timeout_s: float) -> int:
        """Sandboxes of every organization that hold resources on this node."""
        with self._unreachable():
            response = await self._stub.CountSandboxes(
                sandbox_service_pb2.CountSandboxesRequest(), metadata=org_metadata(_PLACEMENT_ORG), timeout=timeout_s
            )
        return int(response.live_count)

    async def create_sandbox(self, sandbox_id: str, spec: SandboxSpec) -> None:
        request = sandbox_service_pb2.CreateSandboxRequest(
            sandbox_id=sandbox_id,
            labels=dict(spec.labels),
            network=spec.network,
            env=dict(spec.env),
            size=_SIZES.get(spec.container_size, sandbox_pb2.CONTAINER_SIZE_UNSPECIFIED),
            secret_substitutions=list(spec.secret_substitutions),
        )
        with self._unreachable(sandbox_id):
            await self._stub.CreateSandbox(request, timeout=self._create_timeout_s)

    async def destroy_sandbox(self, sandbox_id: str) -> None:
        await self._destroy(sandbox_id, metadata=None)

    async def update_secret_substitutions(
        self, sandbox_id: str, substitutions: Sequence[sandbox_pb2.SecretSubstitution]
    ) -> bool:
        request = sandbox_service_pb2.UpdateSecretSubstitutionsRequest(
            sandbox_id=sandbox_id, secret_substitutions=list(substitutions)
        )
        try:
            with self._unreachable(sandbox_id):
                await self._stub.UpdateSecretSubstitutions(request)
        except NotFound:
            return False
        return True

    async def sandbox_alive(self, sandbox_id: str) -> bool:
        try:
            with self._unreachable(sandbox_id):
                response = await self._stub.GetSandbox(sandbox_service_pb2.GetSandboxRequest(sandbox_id=sandbox_id))
        except NotFound:
            return False
        return response.sandbox.state in _ALIVE

    async def destroy_org_sandbox(self, org_id: str, sandbox_id: str) -> None:
        await self._destroy(sandbox_id, metadata=org_metadata(org_id))

    async def _destroy(self, sandbox_id: str, *, metadata: tuple[tuple[str, str], ...] | None) -> None:
        with contextlib.suppress(NotFound), self._unreachable(sandbox_id):
            await self._stub.DestroySandbox(sandbox_service_pb2.DestroySandboxRequest(sandbox_id=sandbox_id), metadata=metadata)

    async def list_environment_sandboxes(self) -> list[EnvironmentSandbox]:
        found: list[EnvironmentSandbox] = []
        token = ""
        while True:
            request = sandbox_service_pb2.ListLabeledSandboxesRequest(
                label_key=ENVIRONMENT_LABEL, page_size=_INVENTORY_PAGE_SIZE, page_token=token
            )
            with self._unreachable():
                response = await self._stub.ListLabeledSandboxes(request, metadata=org_metadata(_INVENTORY_ORG))
            found.extend(
                EnvironmentSandbox(
                    sandbox_id=s.sandbox_id,
                    org_id=s.org_id,
                    environment_id=s.label_value,
                    created_at=s.create_time.ToNanoseconds() / 1e9,
                    node=self.node,
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
            with self._unreachable(sandbox_id):
                async for response in call:
                    if response.HasField("chunk"):
                        yield response.chunk
                    elif response.HasField("exit"):
                        yield response.exit
        finally:
            # Reached on cancellation or early close as well: cancelling the
            # call makes the Sandbox service kill the command's process tree.
            call.cancel()

    async def start_process(self, sandbox_id: str, start: ProcessStart) -> sandbox_pb2.Process:
        with self._unreachable(sandbox_id):
            response = await self._stub.StartProcess(start.request(sandbox_id))
        return response.process

    async def run_process(self, sandbox_id: str, start: ProcessStart) -> AsyncIterator[sandbox_pb2.Process | ExecEvent]:
        call = self._stub.RunProcess(sandbox_service_pb2.RunProcessRequest(start=start.request(sandbox_id)))
        try:
            with self._unreachable(sandbox_id):
                async for response in call:
                    if response.HasField("process"):
                        yield response.process
                    elif response.HasField("chunk"):
                        yield response.chunk
                    elif response.HasField("exit"):
                        yield response.exit
        finally:
            call.cancel()

    async def attach_process(self, sandbox_id: str, process_id: str, *, from_seq: int = 0) -> AsyncIterator[ExecEvent]:
        request = sandbox_service_pb2.AttachProcessRequest(sandbox_id=sandbox_id, process_id=process_id, from_seq=from_seq)
        call = self._stub.AttachProcess(request)
        try:
            with self._unreachable(sandbox_id):
                async for response in call:
                    if response.HasField("chunk"):
                        yield response.chunk
                    elif response.HasField("exit"):
                        yield response.exit
        finally:
            call.cancel()

    async def kill_process(self, sandbox_id: str, process_id: str, *, signal: int = 0) -> sandbox_pb2.Process | None:
        request = sandbox_service_pb2.KillProcessRequest(sandbox_id=sandbox_id, process_id=process_id, signal=signal)
        with self._unreachable(sandbox_id):
            response = await self._stub.KillProcess(request)
        return response.process if response.HasField("process") else None

    async def list_processes(self, sandbox_id: str) -> list[sandbox_pb2.Process]:
        request = sandbox_service_pb2.ListProcessesRequest(sandbox_id=sandbox_id)
        with self._unreachable(sandbox_id):
            response = await self._stub.ListProcesses(request)
        return list(response.processes)

    async def write_process_stdin(self, sandbox_id: str, process_id: str, data: bytes, *, close: bool) -> sandbox_pb2.Process:
        request = sandbox_service_pb2.WriteProcessStdinRequest(
            sandbox_id=sandbox_id, process_id=process_id, data=data, close=close
        )
        with self._unreachable(sandbox_id):
            response = await self._stub.WriteProcessStdin(request)
        return response.process

    async def remove_file(self, sandbox_id: str, path: str) -> None:
        with self._unreachable(sandbox_id):
            await self._stub.RemoveFile(sandbox_service_pb2.RemoveFileRequest(sandbox_id=sandbox_id, path=path))

    async def make_directory(self, sandbox_id: str, path: str) -> None:
        with self._unreachable(sandbox_id):
            await self._stub.MakeDirectory(sandbox_service_pb2.MakeDirectoryRequest(sandbox_id=sandbox_id, path=path))

    async def write_file(self, sandbox_id: str, path: str, data: bytes, *, mode: int = 0) -> common_pb2.FileEntry:
        request = sandbox_service_pb2.WriteFileRequest(sandbox_id=sandbox_id, path=path, data=data, mode=mode)
        with self._unreachable(sandbox_id):
            response = await self._stub.WriteFile(request)
        return response.entry

    async def read_file(self, sandbox_id: str, path: str) -> AsyncIterator[tuple[bytes, int]]:
        call = self._stub.ReadFile(sandbox_service_pb2.ReadFileRequest(sandbox_id=sandbox_id, path=path))
        try:
            with self._unreachable(sandbox_id):
                async for response in call:
                    yield response.data, response.size_bytes
        finally:
            call.cancel()

    async def list_files(self, sandbox_id: str, path: str, *, recursive: bool) -> list[common_pb2.FileEntry]:
        request = sandbox_service_pb2.ListFilesRequest(sandbox_id=sandbox_id, path=path, recursive=recursive)
        with self._unreachable(sandbox_id):
            response = await self._stub.ListFiles(request)
        return list(response.entries)

    async def start_mcp_broker(
        self, sandbox_id: str, label: str, transport: sandbox_pb2.McpTransport
    ) -> tuple[sandbox_pb2.McpBroker, bool]:
        request = sandbox_service_pb2.StartMcpBrokerRequest(sandbox_id=sandbox_id, label=label, transport=transport)
        with self._unreachable(sandbox_id):
            response = await self._stub.StartMcpBroker(request)
        return response.broker, bool(response.created)

    async def list_mcp_brokers(self, sandbox_id: str) -> list[sandbox_pb2.McpBroker]:
        with self._unreachable(sandbox_id):
            response = await self._stub.ListMcpBrokers(sandbox_service_pb2.ListMcpBrokersRequest(sandbox_id=sandbox_id))
        return list(response.brokers)

    async def send_mcp_message(self, sandbox_id: str, label: str, message_json: str, *, timeout_s: float) -> str:
        request = sandbox_service_pb2.SendMcpMessageRequest(sandbox_id=sandbox_id, label=label, message_json=message_json)
        with self._unreachable(sandbox_id):
            response = await self._stub.SendMcpMessage(request, timeout=timeout_s)
        return str(response.message_json)

    async def stop_mcp_broker(self, sandbox_id: str, label: str, *, timeout_s: float) -> sandbox_pb2.McpBroker:
        request = sandbox_service_pb2.StopMcpBrokerRequest(sandbox_id=sandbox_id, label=label)
        with self._unreachable(sandbox_id):
            response = await self._stub.StopMcpBroker(request, timeout=timeout_s)
        return response.broker

    async def close_mcp_upstream(self, sandbox_id: str, label: str, *, timeout_s: float) -> bool:
        request = sandbox_service_pb2.CloseMcpUpstreamRequest(sandbox_id=sandbox_id, label=label)
        with self._unreachable(sandbox_id):
            response = await self._stub.CloseMcpUpstream(request, timeout=timeout_s)
        return bool(response.closed)
