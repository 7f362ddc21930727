"""Thin gRPC adapter: proto request -> domain call -> proto response. Domain
errors propagate to the server interceptor, which maps them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import grpc

from berth.session.v1 import session_pb2, session_service_pb2, session_service_pb2_grpc
from services.core.context import current_org
from services.core.wire_json import to_message
from services.session import views, wire
from services.session.agents import config_message
from services.session.domain import SessionDomain
from services.session.saved_agents import AgentView
from services.session.models import ArtifactRow, ItemRow, TraceRow, TurnRow
from services.session.subagents import subagent_message
from services.session.repository import Page

__all__ = ["SessionServicer"]


def _page(page: session_service_pb2.PageRequest) -> Page:
    return Page(limit=page.limit, after=page.after, before=page.before, order=page.order)


def _agent(view: AgentView) -> session_pb2.Agent:
    row = view.row
    return session_pb2.Agent(
        id=row.id,
        org_id=row.org_id,
        name=row.name,
        config=config_message(view.config),
        create_time=views.timestamp(row.created_at),
        update_time=views.timestamp(row.updated_at),
        metadata=json.loads(row.metadata_json),
        version=row.version,
    )


def _session(view: views.SessionView) -> session_pb2.Session:
    return view.message


def _turn(row: TurnRow) -> session_pb2.Turn:
    return to_message(views.turn_json(row), session_pb2.Turn())


def _item(row: ItemRow) -> session_pb2.Item:
    return to_message(json.loads(row.item_json), session_pb2.Item(session_id=row.session_id))


def _event(sequence: int, event_json: str) -> session_pb2.SessionEvent:
    return to_message(json.loads(event_json), session_pb2.SessionEvent(sequence=sequence))


def _trace(row: TraceRow) -> session_pb2.SessionTrace:
    trace = session_pb2.SessionTrace(id=row.id, created_at=int(row.created_at), session_id=row.session_id)
    trace.otlp.update(json.loads(row.otlp_json))
    return trace


def _artifact(row: ArtifactRow) -> session_pb2.Artifact:
    return session_pb2.Artifact(
        id=row.id,
        session_id=row.session_id,
        turn_id=row.turn_id,
        environment_id=row.environment_id,
        path=row.path,
        size_bytes=row.size_bytes,
        sha256=row.sha256,
        create_time=views.timestamp(row.created_at),
    )


class SessionServicer(session_service_pb2_grpc.SessionServiceServicer):
    def __init__(self, domain: SessionDomain) -> None:
        self.domain = domain

    # agents
    async def CreateAgent(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        view = await self.domain.agents.create_agent(current_org(), request)
        return session_service_pb2.CreateAgentResponse(agent=_agent(view))

    async def GetAgent(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return session_service_pb2.GetAgentResponse(agent=_agent(await self.domain.agents.get_agent(current_org(), request.agent_id)))

    async def ListAgents(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        agents, more = await self.domain.agents.list_agents(current_org(), _page(request.page))
        return session_service_pb2.ListAgentsResponse(agents=[_agent(a) for a in agents], has_more=more)

    async def UpdateAgent(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        view = await self.domain.agents.update_agent(current_org(), request)
        return session_service_pb2.UpdateAgentResponse(agent=_agent(view))

    async def DeleteAgent(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return session_service_pb2.DeleteAgentResponse(agent_id=await self.domain.agents.delete_agent(current_org(), request.agent_id))

    # sessions
    async def CreateSession(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        created = await self.domain.sessions.create_session(current_org(), request)
        return session_service_pb2.CreateSessionResponse(
            session=_session(created.view), turn_id=created.turn_id, created_sequence=created.created_sequence
        )

    async def GetSession(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return session_service_pb2.GetSessionResponse(session=_session(await self.domain.sessions.get_session(current_org(), request.session_id)))

    async def ListSessions(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        sessions, more = await self.domain.sessions.list_sessions(
            current_org(), _page(request.page), request.agent_id, dict(request.metadata)
        )
        return session_service_pb2.ListSessionsResponse(sessions=[_session(s) for s in sessions], has_more=more)

    async def UpdateSession(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        view = await self.domain.sessions.update_session(current_org(), request)
        return session_service_pb2.UpdateSessionResponse(session=_session(view))

    async def DeleteSession(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return session_service_pb2.DeleteSessionResponse(session_id=await self.domain.sessions.delete_session(current_org(), request.session_id))

    # input and events
    async def SubmitSessionEvents(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        result = await self.domain.input.submit_events(current_org(), request.session_id, request.events)
        return session_service_pb2.SubmitSessionEventsResponse(turn_ids=result.turn_ids, sequence=result.sequence)

    async def StreamSessionEvents(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        stream = await self.domain.events.stream_events(
            current_org(), request.session_id, request.after_sequence, follow=request.follow, keepalive_ms=request.keepalive_ms
        )
        now: session_pb2.Session | None = None

        async def typed(sequence: int, event_json: str) -> session_pb2.SessionEvent:
            """One event, read back from its pre-contract form if need be."""
            nonlocal now
            try:
                return _event(sequence, event_json)
            except ValueError:
                if now is None:
                    now = (await self.domain.sessions.get_session(current_org(), request.session_id)).message
                legacy = wire.legacy_status_event(sequence, event_json, now)
                if legacy is None:
                    raise
                return legacy

        async for message in stream:
            if isinstance(message, int):
                yield session_service_pb2.StreamSessionEventsResponse(keepalive_ms=message)
            else:
                try:
                    events = [_event(q, j) for q, _, j in message]
                except ValueError:
                    events = [await typed(q, j) for q, _, j in message]
                yield session_service_pb2.StreamSessionEventsResponse(batch=session_service_pb2.SessionEventBatch(events=events))

    # turns and items
    async def ListTurns(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        turns, more = await self.domain.history.list_turns(current_org(), request.session_id, _page(request.page))
        return session_service_pb2.ListTurnsResponse(turns=[_turn(t) for t in turns], has_more=more)

    async def GetTurn(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return session_service_pb2.GetTurnResponse(turn=_turn(await self.domain.history.get_turn(current_org(), request.session_id, request.turn_id)))

    async def ListItems(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        items, more = await self.domain.history.list_items(current_org(), request.session_id, request.turn_id, _page(request.page))
        return session_service_pb2.ListItemsResponse(items=[_item(i) for i in items], has_more=more)

    async def ListTraces(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        traces, more = await self.domain.traces.list(current_org(), request.session_id, _page(request.page))
        return session_service_pb2.ListTracesResponse(traces=[_trace(t) for t in traces], has_more=more)

    # artifacts
    async def ListArtifacts(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        artifacts, more = await self.domain.history.list_artifacts(current_org(), request.session_id, request.turn_id, _page(request.page))
        return session_service_pb2.ListArtifactsResponse(artifacts=[_artifact(a) for a in artifacts], has_more=more)

    async def GetArtifact(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        row = await self.domain.history.get_artifact(current_org(), request.session_id, request.artifact_id)
        return session_service_pb2.GetArtifactResponse(artifact=_artifact(row))

    async def GetArtifactContent(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        chunks = await self.domain.history.artifact_content(current_org(), request.session_id, request.artifact_id)
        async for chunk in chunks:
            yield session_service_pb2.GetArtifactContentResponse(data=chunk)

    async def DeleteArtifact(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        artifact_id = await self.domain.history.delete_artifact(current_org(), request.session_id, request.artifact_id)
        return session_service_pb2.DeleteArtifactResponse(artifact_id=artifact_id)

    # subagents
    async def ListSubagents(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        rows, more = await self.domain.subagents.list_subagents(current_org(), request.session_id, _page(request.page))
        return session_service_pb2.ListSubagentsResponse(subagents=[subagent_message(r) for r in rows], has_more=more)

    async def GetSubagent(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        row = await self.domain.subagents.get_subagent(current_org(), request.session_id, request.subagent_id)
        return session_service_pb2.GetSubagentResponse(subagent=subagent_message(row))
