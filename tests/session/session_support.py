"""The Session service's test doubles and its typed test client: a fake
Environment service on gRPC, and ``Client``, which drives the Session service
through its stubs as the gateway does."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pydantic
import pytest
from openai.types.beta.agent_session_event import AgentSessionEvent
from grpc_support import TEST_INTERNAL_TOKEN, internal_channel

from berth.common.v1 import common_pb2
from berth.environment.v1 import environment_pb2, environment_service_pb2, environment_service_pb2_grpc
from berth.session.v1 import session_service_pb2, session_service_pb2_grpc
from gateway import convert, render
from gateway.validation import AgentCreateBody, AgentUpdateBody, SessionCreateBody, SessionUpdateBody, validate_body
from services.core.context import current_org
from services.core.errors import EnvironmentFailed, InitializationRunning, NotFound
from services.core.grpc_server import RunningServer, start_grpc_server
from services.core.ids import new_id
from services.core.service import ServiceHandle
from services.core.wire_json import to_message, to_wire
from services.core.settings import Settings
from services.environment.server import ENVIRONMENT_CALLERS
from services.session.models import SessionRow
from services.session.server import start_session_service
from services.session.store import Unit

ORG = "org_a"
OTHER_ORG = "org_b"
EVENT_ADAPTER: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(AgentSessionEvent)


# --------------------------------------------------------------------------- fake environment service
@dataclass
class FakeProcess:
    """A background process of the fake: its output kept whole, so attaching
    from any sequence number loses nothing."""

    process_id: str
    name: str
    proc: asyncio.subprocess.Process
    started: float
    chunks: list[bytes] = field(default_factory=list)
    exit: common_pb2.ExitStatus | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def message(self) -> environment_pb2.Process:
        process = environment_pb2.Process(
            process_id=self.process_id, name=self.name, pid=self.proc.pid, running=self.exit is None, next_seq=len(self.chunks)
        )
        if self.exit is not None:
            process.exit.CopyFrom(self.exit)
        return process


@dataclass
class FakeEnv:
    env: environment_pb2.Environment
    root: Path
    bindings: dict[str, str] = field(default_factory=dict)  # session_id -> role
    setup_task: asyncio.Task[None] | None = None
    processes: dict[str, FakeProcess] = field(default_factory=dict)


class FakeEnvironmentService(environment_service_pb2_grpc.EnvironmentServiceServicer):  # type: ignore[misc]
    """Just enough of the Environment service for the Session service: the
    init guard (with a pluggable setup), bindings, output directories, exec
    with streamed output, background processes, and file reads/writes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.envs: dict[str, FakeEnv] = {}
        self.setup: Callable[[FakeEnv], Awaitable[None]] = self._default_setup
        self.setup_calls = 0
        self.get_calls = 0
        self.detached: list[tuple[str, str]] = []
        self.pids: list[int] = []
        self.exec_cancelled = asyncio.Event()
        self._pumps: set[asyncio.Task[None]] = set()

    async def _default_setup(self, env: FakeEnv) -> None:
        return None

    async def close(self) -> None:
        """Kills every command still running (background ones outlive their
        turns by design) and waits for their output pumps."""
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        if self._pumps:
            await asyncio.wait(self._pumps, timeout=10)

    def _get(self, environment_id: str) -> FakeEnv:
        fake = self.envs.get(environment_id)
        if fake is None or fake.env.org_id != current_org():
            raise NotFound(f"environment {environment_id} not found")
        return fake

    def _output_dir(self, fake: FakeEnv, session_id: str) -> str:
        if fake.bindings.get(session_id) == "owner":
            return "/workspace/outputs"
        return f"/workspace/outputs/sessions/{session_id}"

    def _host(self, fake: FakeEnv, path: str) -> Path:
        rel = os.path.relpath(os.path.normpath(path), "/workspace")
        return fake.root / rel

    async def CreateEnvironment(self, request: Any, context: Any) -> Any:
        env_id = new_id("env")
        env = environment_pb2.Environment(
            id=env_id,
            org_id=current_org(),
            status=environment_pb2.ENVIRONMENT_STATUS_PENDING,
            lifetime=environment_pb2.LIFETIME_PRIVATE,
            sandbox_id=new_id("sbx"),
            config=request.config,
            owner_session_id=request.owner_session_id,
        )
        fake = FakeEnv(env, self.root / env_id)
        fake.root.mkdir(parents=True)
        self.envs[env_id] = fake
        if request.owner_session_id:
            fake.bindings[request.owner_session_id] = "owner"
        fake.env.session_count = len(fake.bindings)
        return environment_service_pb2.CreateEnvironmentResponse(environment=fake.env)

    async def GetEnvironment(self, request: Any, context: Any) -> Any:
        self.get_calls += 1
        return environment_service_pb2.GetEnvironmentResponse(environment=self._get(request.environment_id).env)

    async def AttachSession(self, request: Any, context: Any) -> Any:
        fake = self._get(request.environment_id)
        if fake.env.status == environment_pb2.ENVIRONMENT_STATUS_INITIALIZING:
            raise InitializationRunning("setup is running")
        fake.bindings[request.session_id] = "reference"
        fake.env.lifetime = environment_pb2.LIFETIME_SHARED
        fake.env.ever_shared = True
        fake.env.session_count = len(fake.bindings)
        return environment_service_pb2.AttachSessionResponse(environment=fake.env)

    async def DetachSession(self, request: Any, context: Any) -> Any:
        fake = self._get(request.environment_id)
        fake.bindings.pop(request.session_id, None)
        fake.env.session_count = len(fake.bindings)
        self.detached.append((request.environment_id, request.session_id))
        return environment_service_pb2.DetachSessionResponse(environment_deleted=False)

    async def _run_setup(self, fake: FakeEnv) -> None:
        self.setup_calls += 1
        try:
            await self.setup(fake)
        except Exception as exc:
            fake.env.status = environment_pb2.ENVIRONMENT_STATUS_FAILED
            fake.env.error.CopyFrom(environment_pb2.EnvironmentError(code="setup_command_failed", message=str(exc)))
        else:
            fake.env.status = environment_pb2.ENVIRONMENT_STATUS_READY

    async def _ensure(self, fake: FakeEnv) -> None:
        if fake.env.status == environment_pb2.ENVIRONMENT_STATUS_PENDING:
            fake.env.status = environment_pb2.ENVIRONMENT_STATUS_INITIALIZING
            fake.setup_task = asyncio.create_task(self._run_setup(fake))
        if fake.setup_task is not None:
            await asyncio.shield(fake.setup_task)

    async def EnsureEnvironmentReady(self, request: Any, context: Any) -> Any:
        fake = self._get(request.environment_id)
        await self._ensure(fake)
        return environment_service_pb2.EnsureEnvironmentReadyResponse(environment=fake.env)

    async def _spawn(self, fake: FakeEnv, request: Any) -> asyncio.subprocess.Process:
        """``sh -c request.shell`` for ``request.session_id`` in its own process group."""
        out_dir = self._host(fake, self._output_dir(fake, request.session_id))
        out_dir.mkdir(parents=True, exist_ok=True)
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(fake.root),
            "REBYTE_OUTPUT_DIR": str(out_dir),
            "REBYTE_SESSION_ID": request.session_id,
        }
        cwd = self._host(fake, request.cwd) if request.cwd else fake.root
        proc = await asyncio.create_subprocess_exec(
            "sh",
            "-c",
            request.shell,
            cwd=cwd,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
        self.pids.append(proc.pid)
        return proc

    async def ExecCommand(self, request: Any, context: Any) -> AsyncIterator[Any]:
        fake = self._get(request.environment_id)
        await self._ensure(fake)
        if fake.env.status == environment_pb2.ENVIRONMENT_STATUS_FAILED:
            raise EnvironmentFailed(fake.env.error.message)
        started = time.monotonic()
        proc = await self._spawn(fake, request)
        seq = 0
        try:
            assert proc.stdout is not None
            while True:
                data = await proc.stdout.read(4096)
                if not data:
                    break
                yield environment_service_pb2.ExecCommandResponse(
                    chunk=common_pb2.OutputChunk(stream=common_pb2.OUTPUT_STREAM_STDOUT, seq=seq, data=data)
                )
                seq += 1
            code = await proc.wait()
        except asyncio.CancelledError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            self.exec_cancelled.set()
            raise
        yield environment_service_pb2.ExecCommandResponse(
            exit=common_pb2.ExitStatus(exit_code=code, duration_ms=int((time.monotonic() - started) * 1000))
        )

    async def _pump(self, process: FakeProcess) -> None:
        assert process.proc.stdout is not None
        while data := await process.proc.stdout.read(4096):
            process.chunks.append(data)
            process.changed.set()
        code = await process.proc.wait()
        process.exit = common_pb2.ExitStatus(exit_code=code, duration_ms=int((time.monotonic() - process.started) * 1000))
        process.changed.set()

    async def StartProcess(self, request: Any, context: Any) -> Any:
        fake = self._get(request.environment_id)
        await self._ensure(fake)
        for existing in fake.processes.values() if request.by_name else ():
            if existing.name == request.name:
                return environment_service_pb2.StartProcessResponse(process=existing.message())
        process = FakeProcess(new_id("proc"), request.name, await self._spawn(fake, request), time.monotonic())
        fake.processes[process.process_id] = process
        self._pumps.add(asyncio.create_task(self._pump(process)))
        return environment_service_pb2.StartProcessResponse(process=process.message())

    async def RunProcess(self, request: Any, context: Any) -> AsyncIterator[Any]:
        start = request.start
        started = await self.StartProcess(start, context)
        yield environment_service_pb2.RunProcessResponse(process=started.process)
        attach = environment_service_pb2.AttachProcessRequest(
            environment_id=start.environment_id, process_id=started.process.process_id
        )
        async for message in self.AttachProcess(attach, context):
            if message.HasField("exit"):
                yield environment_service_pb2.RunProcessResponse(exit=message.exit)
            else:
                yield environment_service_pb2.RunProcessResponse(chunk=message.chunk)

    def _process(self, request: Any) -> FakeProcess:
        process = self._get(request.environment_id).processes.get(request.process_id)
        if process is None:
            raise NotFound(f"process {request.process_id} not found")
        return process

    async def AttachProcess(self, request: Any, context: Any) -> AsyncIterator[Any]:
        process = self._process(request)
        seq = int(request.from_seq)
        while True:
            process.changed.clear()
            while seq < len(process.chunks):
                yield environment_service_pb2.AttachProcessResponse(
                    chunk=common_pb2.OutputChunk(stream=common_pb2.OUTPUT_STREAM_STDOUT, seq=seq, data=process.chunks[seq])
                )
                seq += 1
            if process.exit is not None:
                yield environment_service_pb2.AttachProcessResponse(exit=process.exit)
                return
            await process.changed.wait()

    async def KillProcess(self, request: Any, context: Any) -> Any:
        process = self._process(request)
        if process.exit is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.proc.pid, signal.SIGKILL)
            self.exec_cancelled.set()
        return environment_service_pb2.KillProcessResponse(process=process.message())

    async def ListProcesses(self, request: Any, context: Any) -> Any:
        fake = self._get(request.environment_id)
        return environment_service_pb2.ListProcessesResponse(processes=[p.message() for p in fake.processes.values()])

    async def ReadWorkspaceFile(self, request: Any, context: Any) -> AsyncIterator[Any]:
        fake = self._get(request.environment_id)
        await self._ensure(fake)
        path = self._host(fake, request.path)
        if not path.is_file():
            raise NotFound(f"{request.path} does not exist")
        data = path.read_bytes()
        yield environment_service_pb2.ReadWorkspaceFileResponse(data=data, size_bytes=len(data))

    async def WriteWorkspaceFile(self, request: Any, context: Any) -> Any:
        fake = self._get(request.environment_id)
        await self._ensure(fake)
        path = self._host(fake, request.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(request.data)
        return environment_service_pb2.WriteWorkspaceFileResponse(
            entry=common_pb2.FileEntry(path=request.path, type=common_pb2.FILE_TYPE_FILE, size_bytes=len(request.data))
        )

    async def ListSessionOutputs(self, request: Any, context: Any) -> Any:
        fake = self._get(request.environment_id)
        out = self._output_dir(fake, request.session_id)
        host = self._host(fake, out)
        entries = []
        if host.is_dir():
            for path in sorted(host.rglob("*")):
                rel = path.relative_to(host).as_posix()
                if not path.is_file() or (out == "/workspace/outputs" and rel.startswith("sessions/")):
                    continue
                stat = path.stat()
                entries.append(
                    common_pb2.FileEntry(
                        path=f"{out}/{rel}", type=common_pb2.FILE_TYPE_FILE, size_bytes=stat.st_size, mtime=stat.st_mtime
                    )
                )
        # As the real service: the environment read with the binding, when ready.
        ready = fake.env.status == environment_pb2.ENVIRONMENT_STATUS_READY
        return environment_service_pb2.ListSessionOutputsResponse(
            output_dir=out, entries=entries, environment=fake.env if ready else None
        )


# --------------------------------------------------------------------------- client helpers
def validate_event(event: dict[str, Any]) -> Any:
    """Parses an event with the SDK's own union; the chosen model must be the
    one named by ``type`` (so a wrong shape cannot fall through to another)."""
    parsed = EVENT_ADAPTER.validate_python(event)
    assert parsed.type == event["type"], (parsed.type, event["type"])
    return parsed


@dataclass
class Client:
    stub: session_service_pb2_grpc.SessionServiceStub
    org: str = ORG

    @property
    def md(self) -> tuple[tuple[str, str], ...]:
        return (("x-berth-org", self.org),)

    @staticmethod
    def validate(event: dict[str, Any]) -> Any:
        return validate_event(event)

    @staticmethod
    def message(text: str) -> dict[str, Any]:
        return message(text)

    def as_org(self, org: str) -> Client:
        return Client(self.stub, org)

    async def create_agent(self, body: dict[str, Any]) -> dict[str, Any]:
        """A create body, validated and converted as the gateway does it."""
        request = convert.create_agent_request(validate_body(AgentCreateBody, body))
        r = await self.stub.CreateAgent(request, metadata=self.md)
        return render.agent(r.agent)

    async def create_session(self, body: dict[str, Any]) -> Any:
        return await self.stub.CreateSession(
            convert.create_session_request(validate_body(SessionCreateBody, body)), metadata=self.md
        )

    async def update_agent(self, agent_id: str, body: dict[str, Any]) -> Any:
        request = convert.update_agent_request(agent_id, validate_body(AgentUpdateBody, body))
        return await self.stub.UpdateAgent(request, metadata=self.md)

    async def update_session(self, session_id: str, body: dict[str, Any]) -> Any:
        request = convert.update_session_request(session_id, validate_body(SessionUpdateBody, body))
        return await self.stub.UpdateSession(request, metadata=self.md)

    async def get_session(self, session_id: str) -> Any:
        r = await self.stub.GetSession(session_service_pb2.GetSessionRequest(session_id=session_id), metadata=self.md)
        return r.session

    async def submit(self, session_id: str, *events: dict[str, Any]) -> Any:
        return await self.stub.SubmitSessionEvents(
            session_service_pb2.SubmitSessionEventsRequest(
                session_id=session_id, events=[to_message(e, session_service_pb2.InputEvent()) for e in events]
            ),
            metadata=self.md,
        )

    async def say(self, session_id: str, text: str) -> str:
        r = await self.submit(
            session_id,
            {"type": "agent.session.input.message", "input": [{"role": "user", "content": [{"type": "input_text", "text": text}]}]},
        )
        return str(r.turn_ids[0])

    async def events(self, session_id: str, after: int = 0) -> list[tuple[int, dict[str, Any]]]:
        """The persisted backlog (no follow)."""
        out: list[tuple[int, dict[str, Any]]] = []
        call = self.stub.StreamSessionEvents(
            session_service_pb2.StreamSessionEventsRequest(session_id=session_id, after_sequence=after, follow=False),
            metadata=self.md,
        )
        async for m in call:
            out.extend((e.sequence, render.event(e)) for e in m.batch.events)
        return out

    async def wait_for(
        self,
        session_id: str,
        predicate: Callable[[dict[str, Any]], bool],
        *,
        after: int = 0,
        timeout: float = 20.0,
    ) -> list[tuple[int, dict[str, Any]]]:
        """Follows the stream until an event matches; returns everything seen."""
        seen: list[tuple[int, dict[str, Any]]] = []

        async def follow() -> None:
            call = self.stub.StreamSessionEvents(
                session_service_pb2.StreamSessionEventsRequest(session_id=session_id, after_sequence=after, follow=True),
                metadata=self.md,
            )
            try:
                async for m in call:
                    for e in m.batch.events:
                        event = render.event(e)
                        seen.append((e.sequence, event))
                        if predicate(event):
                            return
            finally:
                call.cancel()

        await asyncio.wait_for(follow(), timeout)
        return seen

    async def wait_turn_end(self, session_id: str, turn_id: str, *, timeout: float = 20.0) -> dict[str, Any]:
        seen = await self.wait_for(
            session_id,
            lambda e: e["type"] in ("agent.session.turn.completed", "agent.session.turn.failed", "agent.session.turn.cancelled")
            and e["turn_id"] == turn_id,
            timeout=timeout,
        )
        return seen[-1][1]

    async def items(self, session_id: str, turn_id: str = "", order: str = "asc", limit: int = 100) -> list[dict[str, Any]]:
        r = await self.stub.ListItems(
            session_service_pb2.ListItemsRequest(
                session_id=session_id, turn_id=turn_id, page=session_service_pb2.PageRequest(limit=limit, order=order)
            ),
            metadata=self.md,
        )
        return [to_wire(i) for i in r.items]


def message(text: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "input_text", "text": text}]}




async def add_idle_session(u: Unit, session_id: str, org: str) -> None:
    """A bare idle session row and its ``agent.session.idle`` event, written in ``u``."""
    now = time.time()
    u.session.add(
        SessionRow(
            id=session_id, org_id=org, agent_id="", agent_config_json="{}", environment_kind="none", environment_id="",
            status="idle", error="", metadata_json="{}", vault_ids_json="[]", usage_json="{}", created_at=now,
            last_active_at=now, event_seq=0, active_turn_id=None,
        )
    )
    await u.session.flush()
    await u.emit(session_id, {"type": "agent.session.idle"})
