"""Sessions: ``/v1/agents/sessions`` (update is a POST, as the SDK sends it).

``environment`` may be ``{"type": "none"}``, an inline ``openai_hosted``
configuration, ``{"type": "openai_hosted", "environment_id"}`` or the Rebyte
``{"type": "reference", "environment_id"}``. With ``"stream": true`` the
response is the new session's event stream (see gateway.sse for when it
ends).
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any

import grpc
from fastapi import Query, Request
from fastapi.responses import Response, StreamingResponse

from berth.environment.v1 import environment_pb2
from berth.environment.v1 import environment_service_pb2 as env_pb
from berth.environment.v1 import environment_service_pb2_grpc as env_grpc
from berth.session.v1 import session_pb2
from berth.session.v1 import session_service_pb2 as pb
from gateway import render
from gateway.convert import create_session_request, update_session_request
from gateway.idempotency import IdempotencyDep
from gateway.routes._common import v1_router, PageDep, json_response, read_json, require_id
from gateway.sse import SSE_HEADERS, CreateStreamBoundary, relay_session_events
from gateway.state import EnvironmentStubDep, SessionStubDep, StateDep
from gateway.validation import SessionCreateBody, SessionUpdateBody, check_session_create, metadata_query, validate_body

__all__ = ["router", "render_session", "render_sessions"]

router = v1_router()

_EVENT_STREAM = "text/event-stream"


async def _environment_of(
    s: session_pb2.Session, stub: env_grpc.EnvironmentServiceStub
) -> environment_pb2.Environment | None:
    """The session's environment when the service did not embed it."""
    if s.environment_kind != session_pb2.ENVIRONMENT_KIND_HOSTED or s.environment.id or not s.environment_id:
        return None
    try:
        response = await stub.GetEnvironment(env_pb.GetEnvironmentRequest(environment_id=s.environment_id))
    except grpc.RpcError:
        return None  # rendered with its ID only
    return response.environment


async def render_session(s: session_pb2.Session, stub: env_grpc.EnvironmentServiceStub) -> dict[str, Any]:
    return render.session(s, await _environment_of(s, stub))


async def render_sessions(
    sessions: list[session_pb2.Session], stub: env_grpc.EnvironmentServiceStub
) -> list[dict[str, Any]]:
    environments = await asyncio.gather(*(_environment_of(s, stub) for s in sessions))
    return [render.session(s, e) for s, e in zip(sessions, environments, strict=True)]


def _stream(
    state: StateDep, session_id: str, after_sequence: int, root_turn_id: str, *, obfuscation: bool
) -> StreamingResponse:
    events = relay_session_events(
        state.session,
        session_id,
        after_sequence=after_sequence,
        keepalive_s=state.settings.sse_keepalive_s,
        closing=state.closing,
        boundary=CreateStreamBoundary(root_turn_id=root_turn_id),
        obfuscation=obfuscation,
    )
    return StreamingResponse(events, media_type=_EVENT_STREAM, headers=SSE_HEADERS)


@router.post("/agents/sessions")
async def create_session(
    request: Request, state: StateDep, stub: SessionStubDep, env_stub: EnvironmentStubDep, idempotency: IdempotencyDep
) -> Response:
    body = await read_json(request)
    parsed = validate_body(SessionCreateBody, body.data)
    check_session_create(parsed)
    message = create_session_request(parsed)
    options = parsed.stream_options
    obfuscation = options is None or options.include_obfuscation is not False
    async with idempotency.begin(body.hash) as idem:
        replay = idem.replay
        if replay is not None and replay.media_type == _EVENT_STREAM:
            stored = json.loads(replay.body)
            return _stream(
                state, stored["session_id"], int(stored["after_sequence"]), stored["turn_id"], obfuscation=obfuscation
            )
        if replay is not None:
            return replay.to_response()
        response = await stub.CreateSession(message)
        if parsed.stream:
            after = max(int(response.created_sequence) - 1, 0)
            marker = {"session_id": response.session.id, "turn_id": response.turn_id, "after_sequence": after}
            await idem.store(200, json.dumps(marker), media_type=_EVENT_STREAM)
            return _stream(state, response.session.id, after, response.turn_id, obfuscation=obfuscation)
        content = await render_session(response.session, env_stub)
        await idem.store(200, json.dumps(content))
        return json_response(content)


@router.get("/agents/sessions")
async def list_sessions(
    request: Request,
    stub: SessionStubDep,
    env_stub: EnvironmentStubDep,
    page: PageDep,
    agent_id: Annotated[str | None, Query()] = None,
) -> dict[str, Any]:
    metadata = metadata_query(request.query_params.multi_items())
    response = await stub.ListSessions(
        pb.ListSessionsRequest(page=page.to_proto(), agent_id=agent_id or "", metadata=metadata)
    )
    return render.cursor_page(await render_sessions(list(response.sessions), env_stub), response.has_more)


@router.get("/agents/sessions/{session_id}")
async def retrieve_session(session_id: str, stub: SessionStubDep, env_stub: EnvironmentStubDep) -> dict[str, Any]:
    response = await stub.GetSession(pb.GetSessionRequest(session_id=require_id(session_id, "sess")))
    return await render_session(response.session, env_stub)


@router.post("/agents/sessions/{session_id}")
async def update_session(
    session_id: str, request: Request, stub: SessionStubDep, env_stub: EnvironmentStubDep
) -> dict[str, Any]:
    require_id(session_id, "sess")
    body = await read_json(request)
    response = await stub.UpdateSession(update_session_request(session_id, validate_body(SessionUpdateBody, body.data)))
    return await render_session(response.session, env_stub)


@router.delete("/agents/sessions/{session_id}")
async def delete_session(session_id: str, stub: SessionStubDep) -> dict[str, Any]:
    response = await stub.DeleteSession(pb.DeleteSessionRequest(session_id=require_id(session_id, "sess")))
    return render.deleted(response.session_id or session_id, "agent.session.deleted")
