"""An in-memory ``Compute`` for unit tests of the guard and the domain."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from berth.common.v1 import common_pb2
from berth.sandbox.v1 import sandbox_pb2
from services.core.errors import McpServerDead, NotFound, SandboxUnavailable
from services.environment.compute import ExecEvent, ProcessStart, SandboxRef, SandboxSpec


@dataclass
class ExecCall:
    sandbox_id: str
    argv: list[str]
    shell: str
    cwd: str
    env: dict[str, str]


ExecHandler = Callable[[ExecCall], Awaitable[int]]


@dataclass
class FakeCompute:
    created: list[SandboxSpec] = field(default_factory=list)
    # The sandbox ID of each CreateSandbox call, in call order.
    created_ids: list[str] = field(default_factory=list)
    # Sandboxes that exist but no longer run (the Sandbox service lost them).
    dead: set[str] = field(default_factory=set)
    destroyed: list[str] = field(default_factory=list)
    execs: list[ExecCall] = field(default_factory=list)
    # (sandbox ID, path) of each MakeDirectory call.
    directories: list[tuple[str, str]] = field(default_factory=list)
    files: dict[str, dict[str, bytes]] = field(default_factory=dict)
    # Set to make every call fail as an unreachable Sandbox service would.
    unavailable: bool = False
    # When set, CreateSandbox blocks until it is set.
    create_gate: asyncio.Event | None = None
    create_started: asyncio.Event = field(default_factory=asyncio.Event)
    exec_handler: ExecHandler | None = None
    exec_cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    # sandbox_id -> label -> broker; the first start of a label creates it.
    brokers: dict[str, dict[str, sandbox_pb2.McpBroker]] = field(default_factory=dict)
    # ("stop" | "close" | "destroy", sandbox_id, label) in call order.
    mcp_calls: list[tuple[str, str, str]] = field(default_factory=list)
    # (sandbox_id, label) -> the transport the broker was started with.
    mcp_transports: dict[tuple[str, str], sandbox_pb2.McpTransport] = field(default_factory=dict)
    # sandbox_id -> process_id -> process; processes never exit on their own.
    processes: dict[str, dict[str, sandbox_pb2.Process]] = field(default_factory=dict)
    # process_id -> everything written to its stdin.
    stdin: dict[str, bytearray] = field(default_factory=dict)
    # (sandbox_id, substitutions) of each UpdateSecretSubstitutions call.
    substitution_updates: list[tuple[str, list[sandbox_pb2.SecretSubstitution]]] = field(default_factory=list)

    def setup_runs(self, command: str) -> int:
        return sum(1 for c in self.execs if c.shell == command)

    def _check(self) -> None:
        if self.unavailable:
            raise SandboxUnavailable("sandbox service unreachable")

    async def place_sandbox(self, previous_node: str | None) -> str:
        self._check()
        return ""

    async def create_sandbox(self, sandbox: SandboxRef, spec: SandboxSpec) -> None:
        self._check()
        self.created.append(spec)
        self.created_ids.append(sandbox.sandbox_id)
        self.files.setdefault(sandbox.sandbox_id, {})
        self.create_started.set()
        if self.create_gate is not None:
            await self.create_gate.wait()

    async def destroy_sandbox(self, sandbox: SandboxRef) -> None:
        self._check()
        sandbox_id = sandbox.sandbox_id
        self.mcp_calls.append(("destroy", sandbox_id, ""))
        self.destroyed.append(sandbox_id)
        self.files.pop(sandbox_id, None)

    async def update_secret_substitutions(
        self, sandbox: SandboxRef, substitutions: Sequence[sandbox_pb2.SecretSubstitution]
    ) -> bool:
        self._check()
        if sandbox.sandbox_id not in self.files:
            return False
        self.substitution_updates.append((sandbox.sandbox_id, list(substitutions)))
        return True

    async def sandbox_alive(self, sandbox: SandboxRef) -> bool:
        self._check()
        sandbox_id = sandbox.sandbox_id
        return sandbox_id in self.files and sandbox_id not in self.dead

    async def exec(
        self,
        sandbox: SandboxRef,
        *,
        argv: Sequence[str] = (),
        shell: str = "",
        cwd: str = "",
        env: Mapping[str, str] | None = None,
        timeout_ms: int = 0,
    ) -> AsyncIterator[ExecEvent]:
        self._check()
        call = ExecCall(sandbox.sandbox_id, list(argv), shell, cwd, dict(env or {}))
        self.execs.append(call)
        code = 0
        try:
            if self.exec_handler is not None and call.argv[:1] != ["mkdir"]:
                code = await self.exec_handler(call)
        except asyncio.CancelledError:
            self.exec_cancelled.set()
            raise
        yield common_pb2.OutputChunk(stream=common_pb2.OUTPUT_STREAM_STDOUT, seq=0, data=b"ok\n")
        yield common_pb2.ExitStatus(exit_code=code)

    async def make_directory(self, sandbox: SandboxRef, path: str) -> None:
        self._check()
        self.directories.append((sandbox.sandbox_id, path))

    async def write_file(self, sandbox: SandboxRef, path: str, data: bytes, *, mode: int = 0) -> common_pb2.FileEntry:
        self._check()
        sandbox_id = sandbox.sandbox_id
        self.files.setdefault(sandbox_id, {})[path] = data
        return common_pb2.FileEntry(path=path, type=common_pb2.FILE_TYPE_FILE, size_bytes=len(data))

    async def read_file(self, sandbox: SandboxRef, path: str) -> AsyncIterator[tuple[bytes, int]]:
        self._check()
        sandbox_id = sandbox.sandbox_id
        data = self.files.get(sandbox_id, {}).get(path)
        if data is None:
            raise NotFound(f"{path} does not exist")
        yield data, len(data)

    async def list_files(self, sandbox: SandboxRef, path: str, *, recursive: bool) -> list[common_pb2.FileEntry]:
        self._check()
        sandbox_id = sandbox.sandbox_id
        prefix = path.rstrip("/") + "/"
        found = [
            common_pb2.FileEntry(path=p, type=common_pb2.FILE_TYPE_FILE, size_bytes=len(d))
            for p, d in self.files.get(sandbox_id, {}).items()
            if p.startswith(prefix) and (recursive or "/" not in p[len(prefix):])
        ]
        if not found and path != "/workspace":
            raise NotFound(f"{path} does not exist")
        return found

    async def start_mcp_broker(
        self, sandbox: SandboxRef, label: str, transport: sandbox_pb2.McpTransport
    ) -> tuple[sandbox_pb2.McpBroker, bool]:
        self._check()
        sandbox_id = sandbox.sandbox_id
        brokers = self.brokers.setdefault(sandbox_id, {})
        if label in brokers:
            return brokers[label], False
        self.mcp_transports[(sandbox_id, label)] = transport
        kind = sandbox_pb2.MCP_TRANSPORT_TYPE_STDIO if transport.HasField("stdio") else sandbox_pb2.MCP_TRANSPORT_TYPE_HTTP
        brokers[label] = sandbox_pb2.McpBroker(
            label=label, transport_type=kind, state=sandbox_pb2.MCP_BROKER_STATE_RUNNING, pid=100 + len(brokers)
        )
        return brokers[label], True

    async def start_process(self, sandbox: SandboxRef, start: ProcessStart) -> sandbox_pb2.Process:
        self._check()
        table = self.processes.setdefault(sandbox.sandbox_id, {})
        for existing in table.values() if start.by_name else ():
            if existing.name == start.name:
                return existing
        process = sandbox_pb2.Process(
            process_id=f"proc_{len(table) + 1}", name=start.name, running=True, keepalive=start.keepalive, stdin_open=start.stdin
        )
        table[process.process_id] = process
        return process

    async def run_process(self, sandbox: SandboxRef, start: ProcessStart) -> AsyncIterator[sandbox_pb2.Process | ExecEvent]:
        process = await self.start_process(sandbox, start)
        yield process
        async for event in self.attach_process(sandbox, process.process_id):
            yield event

    async def attach_process(self, sandbox: SandboxRef, process_id: str, *, from_seq: int = 0) -> AsyncIterator[ExecEvent]:
        self._check()
        process = self.processes.get(sandbox.sandbox_id, {}).get(process_id)
        if process is None:
            raise NotFound(f"process {process_id} not found")
        if not process.running:
            yield process.exit

    async def kill_process(self, sandbox: SandboxRef, process_id: str, *, signal: int = 0) -> sandbox_pb2.Process | None:
        self._check()
        process = self.processes.get(sandbox.sandbox_id, {}).get(process_id)
        if process is not None:
            process.running = False
            process.exit.CopyFrom(common_pb2.ExitStatus(exit_code=-(signal or 9)))
        return process

    async def list_processes(self, sandbox: SandboxRef) -> list[sandbox_pb2.Process]:
        self._check()
        return list(self.processes.get(sandbox.sandbox_id, {}).values())

    async def write_process_stdin(
        self, sandbox: SandboxRef, process_id: str, data: bytes, *, close: bool
    ) -> sandbox_pb2.Process:
        self._check()
        process = self.processes.get(sandbox.sandbox_id, {}).get(process_id)
        if process is None:
            raise NotFound(f"process {process_id} not found")
        self.stdin.setdefault(process_id, bytearray()).extend(data)
        if close:
            process.stdin_open = False
        return process

    async def remove_file(self, sandbox: SandboxRef, path: str) -> None:
        self._check()
        if self.files.get(sandbox.sandbox_id, {}).pop(path, None) is None:
            raise NotFound(f"{path} does not exist")

    async def list_mcp_brokers(self, sandbox: SandboxRef) -> list[sandbox_pb2.McpBroker]:
        self._check()
        sandbox_id = sandbox.sandbox_id
        return list(self.brokers.get(sandbox_id, {}).values())

    async def send_mcp_message(self, sandbox: SandboxRef, label: str, message_json: str, *, timeout_s: float) -> str:
        self._check()
        sandbox_id = sandbox.sandbox_id
        broker = self.brokers.get(sandbox_id, {}).get(label)
        if broker is None:
            raise NotFound(f"no MCP broker {label}")
        if broker.state == sandbox_pb2.MCP_BROKER_STATE_DEAD:
            raise McpServerDead(f"MCP server {label} is dead")
        return message_json

    async def stop_mcp_broker(self, sandbox: SandboxRef, label: str, *, timeout_s: float) -> sandbox_pb2.McpBroker:
        self._check()
        sandbox_id = sandbox.sandbox_id
        self.mcp_calls.append(("stop", sandbox_id, label))
        broker = self.brokers[sandbox_id][label]
        broker.state = sandbox_pb2.MCP_BROKER_STATE_DEAD
        return broker

    async def close_mcp_upstream(self, sandbox: SandboxRef, label: str, *, timeout_s: float) -> bool:
        self._check()
        sandbox_id = sandbox.sandbox_id
        self.mcp_calls.append(("close", sandbox_id, label))
        broker = self.brokers.get(sandbox_id, {}).get(label)
        return broker is not None and broker.transport_type == sandbox_pb2.MCP_TRANSPORT_TYPE_HTTP
