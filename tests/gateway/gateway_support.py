"""Support for the gateway tests: in-test gRPC fakes of the Session and
Environment services, and the running stack the fixtures hand to tests.

The fakes implement the generated servicer bases with just enough
behaviour to exercise the gateway: they keep resources in dicts scoped by
the ``x-berth-org`` metadata (another org's resource is NOT_FOUND, as in
the real services), record every call, and raise a configured domain error
per method (the core server interceptor turns it into a rich status).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
from google.protobuf.timestamp_pb2 import Timestamp

from berth.environment.v1 import environment_pb2 as env_pb
from berth.environment.v1 import environment_service_pb2 as env_svc
from berth.environment.v1 import environment_service_pb2_grpc as env_grpc
from berth.session.v1 import session_pb2 as s_pb
from berth.session.v1 import session_service_pb2 as s_svc
from berth.session.v1 import session_service_pb2_grpc as s_grpc
from gateway.app import GatewayHandle
from grpc_support import TEST_INTERNAL_TOKEN
from services.core.context import ORG_METADATA_KEY, REQUEST_ID_METADATA_KEY
from services.core.errors import BerthError, NotFound
from services.core.ids import new_id
from services.core.grpc_server import RunningServer, start_grpc_server
from services.core.settings import Settings
from services.core.wire_json import to_message, to_wire
from services.environment.server import ENVIRONMENT_CALLERS
from services.session.server import SESSION_CALLERS

BETA = {"OpenAI-Beta": "agents=v1"}


def domain_error(code: grpc.StatusCode, reason: str, message: str = "failed", **metadata: str) -> BerthError:
    """A domain error with any (code, reason) pair, as a service would raise it."""
    cls = type(f"{reason or code.name}Error", (BerthError,), {"grpc_code": code, "reason": reason})
    return cls(message, **metadata)


def _now() -> Timestamp:
    ts = Timestamp()
    ts.FromSeconds(int(time.time()))
    return ts


def session_event(session: s_pb.Session, kind: str, sequence: int, **fields: Any) -> s_pb.SessionEvent:
    payload: dict[str, Any] = {"event_id": f"evt_{sequence}", "type": kind, **fields}
    if kind in ("agent.session.created", "agent.session.idle", "agent.session.in_progress", "agent.session.failed"):
        payload["session"] = to_wire(session)
    else:
        payload.setdefault("session_id", session.id)
    return to_message(payload, s_pb.SessionEvent(sequence=sequence))


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, str]] = []
        self.request_ids: list[str] = []
        self.fail: dict[str, BerthError] = {}

    def enter(self, name: str, request: Any, context: grpc.aio.ServicerContext) -> str:
        metadata = dict(context.invocation_metadata() or ())
        org = metadata.get(ORG_METADATA_KEY, "")
        self.calls.append((name, request, str(org)))
        self.request_ids.append(str(metadata.get(REQUEST_ID_METADATA_KEY, "")))
        if name in self.fail:
            raise self.fail[name]
        return str(org)

    def count(self, name: str) -> int:
        return sum(1 for n, _, _ in self.calls if n == name)

    def last(self, name: str) -> Any:
        return [r for n, r, _ in self.calls if n == name][-1]


class FakeEnvironmentService(env_grpc.EnvironmentServiceServicer, _Recorder):
    def __init__(self) -> None:
        _Recorder.__init__(self)
        self.environments: dict[str, tuple[str, env_pb.Environment]] = {}
        self.files: dict[str, tuple[str, env_pb.StoredFile, bytes]] = {}
        self.registered: dict[str, list[env_pb.RegisteredFile]] = {}

    def _env(self, org: str, environment_id: str) -> env_pb.Environment:
        found = self.environments.get(environment_id)
        if found is None or found[0] != org:
            raise NotFound(f"environment {environment_id} not found")
        return found[1]

    def add_environment(self, org: str, **fields: Any) -> env_pb.Environment:
        env = env_pb.Environment(
            id=new_id("env"),
            org_id=org,
            status=env_pb.ENVIRONMENT_STATUS_PENDING,
            lifetime=env_pb.LIFETIME_PRIVATE,
            sandbox_id=new_id("sbx"),
            create_time=_now(),
            **fields,
        )
        self.environments[env.id] = (org, env)
        return env

    async def CreateEnvironment(self, request: env_svc.CreateEnvironmentRequest, context: Any) -> Any:  # noqa: N802
        org = self.enter("CreateEnvironment", request, context)
        config = env_pb.EnvironmentConfig()
        config.CopyFrom(request.config)
        for f in config.files:
            f.id = new_id("file").replace("file-", "envf_")
            f.size_bytes = len(f.data)
        env = self.add_environment(org, config=config, vault_ids=list(request.vault_ids))
        return env_svc.CreateEnvironmentResponse(environment=env)

    async def GetEnvironment(self, request: env_svc.GetEnvironmentRequest, context: Any) -> Any:  # noqa: N802
        org = self.enter("GetEnvironment", request, context)
        return env_svc.GetEnvironmentResponse(environment=self._env(org, request.environment_id))

    async def ListEnvironments(self, request: env_svc.ListEnvironmentsRequest, context: Any) -> Any:  # noqa: N802
        org = self.enter("ListEnvironments", request, context)
        mine = sorted((e for o, e in self.environments.values() if o == org), key=lambda e: e.id)
        if request.order != "asc":
            mine.reverse()
        if request.after:
            ids = [e.id for e in mine]
            mine = mine[ids.index(request.after) + 1 :] if request.after in ids else []
        size = request.page_size or 20
        return env_svc.ListEnvironmentsResponse(environments=mine[:size], has_more=len(mine) > size)

    async def DeleteEnvironment(self, request: env_svc.DeleteEnvironmentRequest, context: Any) -> Any:  # noqa: N802
        org = self.enter("DeleteEnvironment", request, context)
        self._env(org, request.environment_id)
        del self.environments[request.environment_id]
        return env_svc.DeleteEnvironmentResponse(environment_id=request.environment_id)

    async def CreateEnvironmentFile(self, request: env_svc.CreateEnvironmentFileRequest, context: Any) -> Any:  # noqa: N802
        org = self.enter("CreateEnvironmentFile", request, context)
        self._env(org, request.environment_id)
        if request.WhichOneof("source") == "file_id":
            stored = self.files.get(request.file_id)
            if stored is None or stored[0] != org:
                raise NotFound("file not found")
            size, source = len(stored[2]), "file_id"
        else:
            size, source = len(request.data), "inline"
        registered = env_pb.RegisteredFile(
            environment_id=request.environment_id,
            path=request.path,
            size_bytes=size,
            source=source,
            file_id=request.file_id,
            id=new_id("file").replace("file-", "envf_"),
        )
        self.registered.setdefault(request.environment_id, []).append(registered)
        return env_svc.CreateEnvironmentFileResponse(file=registered)

    async def ListEnvironmentFiles(self, request: env_svc.ListEnvironmentFilesRequest, context: Any) -> Any:  # noqa: N802
        org = self.enter("ListEnvironmentFiles", request, context)
        self._env(org, request.environment_id)
        files = sorted(self.registered.get(request.environment_id, []), key=lambda f: f.path)
        start = int(request.page_token or 0)
        size = request.page_size or 20
        page = files[start : start + size]
        token = str(start + size) if start + size < len(files) else ""
        return env_svc.ListEnvironmentFilesResponse(files=page, next_page_token=token)

    async def CreateStoredFile(self, request: env_svc.CreateStoredFileRequest, context: Any) -> Any:  # noqa: N802
        org = self.enter("CreateStoredFile", request, context)
        stored = env_pb.StoredFile(
            id=new_id("file"),
            filename=request.filename,
            purpose=request.purpose,
            size_bytes=len(request.data),
            create_time=_now(),
        )
        self.files[stored.id] = (org, stored, bytes(request.data))
        return env_svc.CreateStoredFileResponse(file=stored)

    def _file(self, org: str, file_id: str) -> tuple[str, env_pb.StoredFile, bytes]:
        found = self.files.get(file_id)
        if found is None or found[0] != org:
            raise NotFound("file not found")
        return found

    async def GetStoredFile(self, request: env_svc.GetStoredFileRequest, context: Any) -> Any:  # noqa: N802
        org = self.enter("GetStoredFile", request, context)
        return env_svc.GetStoredFileResponse(file=self._file(org, request.file_id)[1])

    async def GetStoredFileContent(self, request: env_svc.GetStoredFileContentRequest, context: Any) -> Any:  # noqa: N802
        org = self.enter("GetStoredFileContent", request, context)
        data = self._file(org, request.file_id)[2]
        for i in range(0, max(len(data), 1), 4):
            yield env_svc.GetStoredFileContentResponse(data=data[i : i + 4])

    async def DeleteStoredFile(self, request: env_svc.DeleteStoredFileRequest, context: Any) -> Any:  # noqa: N802
        org = self.enter("DeleteStoredFile", request, context)
        self._file(org, request.file_id)
        del self.files[request.file_id]
        return env_svc.DeleteStoredFileResponse(file_id=request.file_id)

    async def ListStoredFiles(self, request: env_svc.ListStoredFilesRequest, context: Any) -> Any:  # noqa: N802
        org = self.enter("ListStoredFiles", request, context)
        mine = [f for o, f, _ in self.files.values() if o == org]
        return env_svc.ListStoredFilesResponse(files=mine, has_more=False)


@dataclass
class FakeSession:
    org: str
    session: s_pb.Session
    events: list[s_pb.SessionEvent] = field(default_factory=list)


class FakeSessionService(s_grpc.SessionServiceServicer, _Recorder):
    def __init__(self, environments: FakeEnvironmentService) -> None:
        _Recorder.__init__(self)
        self.environments = environments
        self.sessions: dict[str, FakeSession] = {}
        self.agents: dict[str, tuple[str, s_pb.Agent]] = {}
        self.artifacts: dict[str, tuple[str, s_pb.Artifact, bytes]] = {}
        # Messages StreamSessionEvents sends before the backlog (e.g. a keep-alive).
        self.stream_prefix: list[s_svc.StreamSessionEventsResponse] = []
        # When set, StreamSessionEvents sends the backlog as one batch message.
        self.batch_events = False
        # When set, StreamSessionEvents waits on it after the backlog (a live follow).
        self.hold_stream: asyncio.Event | None = None
        # Set when a stream starts waiting on hold_stream, and when such a
        # waiting stream is cancelled by its client (the gateway).
        self.stream_waiting = asyncio.Event()
        self.stream_cancelled = asyncio.Event()
        # A service keep-alive after every event.
        self.keepalive_between_events = False
        # Events CreateSession appends to a new session's log.
        self.creation_script: list[tuple[str, dict[str, Any]]] = []

    def _session(self, org: str, session_id: str) -> FakeSession:
        found = self.sessions.get(session_id)
        if found is None or found.org != org:
            raise NotFound(f"session {session_id} not found")
        return found

    def add_session(self, org: str, *, environment: env_pb.Environment | None = None) -> FakeSession:
        session_id = new_id("sess")
        agent_id = new_id("agent")
        session = s_pb.Session(
            id=session_id,
            org_id=org,
            agent_id=agent_id,
            agent=s_pb.SessionAgent(id=agent_id, config=s_pb.AgentConfig(model="gpt-test", service_tier="auto")),
            environment_kind=s_pb.ENVIRONMENT_KIND_HOSTED if environment else s_pb.ENVIRONMENT_KIND_NONE,
            environment_id=environment.id if environment else "",
            status=s_pb.SESSION_STATUS_IDLE,
            create_time=_now(),
            last_active_time=_now(),
        )
        if environment is not None:
            session.environment.CopyFrom(environment)
        fake = FakeSession(org=org, session=session)
        self.sessions[session_id] = fake
        return fake

    def append(self, fake: FakeSession, kind: str, **fields: Any) -> s_pb.SessionEvent:
        event = session_event(fake.session, kind, len(fake.events) + 1, **fields)
        fake.events.append(event)
        return event

    async def CreateAgent(self, request: s_svc.CreateAgentRequest, context: Any) -> Any:  # noqa: N802
        org = self.enter("CreateAgent", request, context)
        agent_id = new_id("agent")
        agent = s_pb.Agent(id=agent_id, org_id=org, name=request.name if request.HasField("name") else None, config=request.config,
                           metadata=request.metadata, create_time=_now(), update_time=_now())
        self.agents[agent_id] = (org, agent)
        return s_svc.CreateAgentResponse(agent=agent)

    async def GetAgent(self, request: s_svc.GetAgentRequest, context: Any) -> Any:  # noqa: N802
        org = self.enter("GetAgent", request, context)
        found = self.agents.get(request.agent_id)
        if found is None or found[0] != org:
            raise NotFound("agent not found")
        return s_svc.GetAgentResponse(agent=found[1])

    async def ListAgents(self, request: s_svc.ListAgentsRequest, context: Any) -> Any:  # noqa: N802
        org = self.enter("ListAgents", request, context)
        return s_svc.ListAgentsResponse(agents=[a for o, a in self.agents.values() if o == org], has_more=False)

    async def CreateSession(self, request: s_svc.CreateSessionRequest, context: Any) -> Any:  # noqa: N802
        org = self.enter("CreateSession", request, context)
        kind = request.environment.WhichOneof("environment")
        environment = None
        if kind == "environment_id":
            environment = self.environments._env(org, request.environment.environment_id)
        elif kind == "inline":
            environment = self.environments.add_environment(org)
        fake = self.add_session(org, environment=environment)
        fake.session.metadata.update(request.metadata)
        created = self.append(fake, "agent.session.created")
        turn_id = ""
        for kind, fields in self.creation_script:
            if kind == "agent.session.turn.created":
                turn_id = fields["turn_id"]
            self.append(fake, kind, **fields)
        return s_svc.CreateSessionResponse(session=fake.session, turn_id=turn_id, created_sequence=created.sequence)

    async def GetSession(self, request: s_svc.GetSessionRequest, context: Any) -> Any:  # noqa: N802
        org = self.enter("GetSession", request, context)
        return s_svc.GetSessionResponse(session=self._session(org, request.session_id).session)

    async def ListSessions(self, request: s_svc.ListSessionsRequest, context: Any) -> Any:  # noqa: N802
        org = self.enter("ListSessions", request, context)
        mine = [f.session for f in self.sessions.values() if f.org == org]
        size = request.page.limit or 20
        return s_svc.ListSessionsResponse(sessions=mine[:size], has_more=len(mine) > size)

    async def DeleteSession(self, request: s_svc.DeleteSessionRequest, context: Any) -> Any:  # noqa: N802
        org = self.enter("DeleteSession", request, context)
        self._session(org, request.session_id)
        del self.sessions[request.session_id]
        return s_svc.DeleteSessionResponse(session_id=request.session_id)

    async def SubmitSessionEvents(self, request: s_svc.SubmitSessionEventsRequest, context: Any) -> Any:  # noqa: N802
        org = self.enter("SubmitSessionEvents", request, context)
        fake = self._session(org, request.session_id)
        return s_svc.SubmitSessionEventsResponse(turn_ids=[], sequence=len(fake.events))

    async def StreamSessionEvents(self, request: s_svc.StreamSessionEventsRequest, context: Any) -> Any:  # noqa: N802
        org = self.enter("StreamSessionEvents", request, context)
        fake = self._session(org, request.session_id)
        for message in self.stream_prefix:
            yield message
        if self.batch_events:
            yield s_svc.StreamSessionEventsResponse(
                batch=s_svc.SessionEventBatch(events=[e for e in fake.events if e.sequence > request.after_sequence])
            )
        for event in [] if self.batch_events else fake.events:
            if event.sequence > request.after_sequence:
                yield s_svc.StreamSessionEventsResponse(event=event)
                if self.keepalive_between_events:
                    yield s_svc.StreamSessionEventsResponse(keepalive_ms=int(time.time() * 1000))
        if self.hold_stream is not None:
            self.stream_waiting.set()
            try:
                await self.hold_stream.wait()
            except asyncio.CancelledError:
                self.stream_cancelled.set()
                raise

    async def ListTurns(self, request: s_svc.ListTurnsRequest, context: Any) -> Any:  # noqa: N802
        org = self.enter("ListTurns", request, context)
        self._session(org, request.session_id)
        turn = {"id": "turn_1", "object": "agent.session.turn", "session_id": request.session_id,
                "agent_id": "agent_1", "created_at": 1, "status": "completed"}
        return s_svc.ListTurnsResponse(
            turns=[to_message(turn, s_pb.Turn())], has_more=False
        )

    def add_artifact(self, fake: FakeSession, path: str, data: bytes) -> s_pb.Artifact:
        artifact = s_pb.Artifact(
            id=new_id("art"),
            session_id=fake.session.id,
            turn_id="turn_1",
            environment_id=fake.session.environment_id or "env_1",
            path=path,
            size_bytes=len(data),
            create_time=_now(),
        )
        self.artifacts[artifact.id] = (fake.org, artifact, data)
        return artifact

    def _artifact(self, org: str, session_id: str, artifact_id: str) -> tuple[str, s_pb.Artifact, bytes]:
        found = self.artifacts.get(artifact_id)
        if found is None or found[0] != org or found[1].session_id != session_id:
            raise NotFound("artifact not found")
        return found

    async def ListArtifacts(self, request: s_svc.ListArtifactsRequest, context: Any) -> Any:  # noqa: N802
        org = self.enter("ListArtifacts", request, context)
        self._session(org, request.session_id)
        mine = [a for o, a, _ in self.artifacts.values() if o == org and a.session_id == request.session_id]
        return s_svc.ListArtifactsResponse(artifacts=mine, has_more=False)

    async def GetArtifact(self, request: s_svc.GetArtifactRequest, context: Any) -> Any:  # noqa: N802
        org = self.enter("GetArtifact", request, context)
        return s_svc.GetArtifactResponse(artifact=self._artifact(org, request.session_id, request.artifact_id)[1])

    async def GetArtifactContent(self, request: s_svc.GetArtifactContentRequest, context: Any) -> Any:  # noqa: N802
        org = self.enter("GetArtifactContent", request, context)
        data = self._artifact(org, request.session_id, request.artifact_id)[2]
        for i in range(0, len(data), 3):
            yield s_svc.GetArtifactContentResponse(data=data[i : i + 3])

    async def DeleteArtifact(self, request: s_svc.DeleteArtifactRequest, context: Any) -> Any:  # noqa: N802
        org = self.enter("DeleteArtifact", request, context)
        self._artifact(org, request.session_id, request.artifact_id)
        del self.artifacts[request.artifact_id]
        return s_svc.DeleteArtifactResponse(artifact_id=request.artifact_id)


async def _serve(address: str, add: Callable[[Any, grpc.aio.Server], None], fake: Any, name: str, callers: Any) -> RunningServer:
    def register(server: grpc.aio.Server) -> list[str]:
        add(fake, server)
        return [name]

    return await start_grpc_server(address, register, token=TEST_INTERNAL_TOKEN, callers=callers)


async def serve_environment(fake: FakeEnvironmentService, address: str = "127.0.0.1:0") -> RunningServer:
    """A real gRPC server on ``address`` whose Environment service is ``fake``."""
    return await _serve(
        address, env_grpc.add_EnvironmentServiceServicer_to_server, fake, "berth.environment.v1.EnvironmentService",
        ENVIRONMENT_CALLERS,
    )


async def serve_session(fake: FakeSessionService, address: str = "127.0.0.1:0") -> RunningServer:
    """A real gRPC server on ``address`` whose Session service is ``fake``."""
    return await _serve(
        address, s_grpc.add_SessionServiceServicer_to_server, fake, "berth.session.v1.SessionService", SESSION_CALLERS
    )


@dataclass
class Stack:
    gateway: GatewayHandle
    session: FakeSessionService
    environment: FakeEnvironmentService
    settings: Settings
    key: str
    org_id: str

    @property
    def base_url(self) -> str:
        return self.gateway.base_url

    @property
    def db(self) -> Any:
        return self.gateway.app.state.berth.db

    def client(self, key: str | None = None, *, beta: bool = True) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {key or self.key}"}
        if beta:
            headers.update(BETA)
        return httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=10)
