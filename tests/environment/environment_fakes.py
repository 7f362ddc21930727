"""An in-memory ``Compute`` for unit tests of the guard and the domain."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from berth.common.v1 import common_pb2
from services.core.errors import NotFound, SandboxUnavailable
from services.environment.compute import ExecEvent, SandboxSpec


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
    destroyed: list[str] = field(default_factory=list)
    execs: list[ExecCall] = field(default_factory=list)
    files: dict[str, dict[str, bytes]] = field(default_factory=dict)
    # Set to make every call fail as an unreachable Sandbox service would.
    unavailable: bool = False
    # When set, CreateSandbox blocks until it is set.
    create_gate: asyncio.Event | None = None
    create_started: asyncio.Event = field(default_factory=asyncio.Event)
    exec_handler: ExecHandler | None = None
    exec_cancelled: asyncio.Event = field(default_factory=asyncio.Event)

    def setup_runs(self, command: str) -> int:
        return sum(1 for c in self.execs if c.shell == command)

    def _check(self) -> None:
        if self.unavailable:
            raise SandboxUnavailable("sandbox service unreachable")

    async def create_sandbox(self, spec: SandboxSpec) -> None:
        self._check()
        self.created.append(spec)
        self.files.setdefault(spec.sandbox_id, {})
        self.create_started.set()
        if self.create_gate is not None:
            await self.create_gate.wait()

    async def destroy_sandbox(self, sandbox_id: str) -> None:
        self._check()
        self.destroyed.append(sandbox_id)
        self.files.pop(sandbox_id, None)

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
        self._check()
        call = ExecCall(sandbox_id, list(argv), shell, cwd, dict(env or {}))
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

    async def write_file(self, sandbox_id: str, path: str, data: bytes, *, mode: int = 0) -> common_pb2.FileEntry:
        self._check()
        self.files.setdefault(sandbox_id, {})[path] = data
        return common_pb2.FileEntry(path=path, type=common_pb2.FILE_TYPE_FILE, size_bytes=len(data))

    async def read_file(self, sandbox_id: str, path: str) -> AsyncIterator[tuple[bytes, int]]:
        self._check()
        data = self.files.get(sandbox_id, {}).get(path)
        if data is None:
            raise NotFound(f"{path} does not exist")
        yield data, len(data)

    async def list_files(self, sandbox_id: str, path: str, *, recursive: bool) -> list[common_pb2.FileEntry]:
        self._check()
        prefix = path.rstrip("/") + "/"
        found = [
            common_pb2.FileEntry(path=p, type=common_pb2.FILE_TYPE_FILE, size_bytes=len(d))
            for p, d in self.files.get(sandbox_id, {}).items()
            if p.startswith(prefix) and (recursive or "/" not in p[len(prefix):])
        ]
        if not found and path != "/workspace":
            raise NotFound(f"{path} does not exist")
        return found
