"""What lives under one session: input events and the SSE event stream,
turns, items, traces and artifacts."""

from __future__ import annotations

import mimetypes
from typing import Annotated, Any

from fastapi import Header, Query, Request
from fastapi.responses import Response, StreamingResponse

from berth.session.v1 import session_service_pb2 as pb
from gateway import render
from gateway.errors import ApiError
from gateway.idempotency import IdempotencyDep
from gateway.routes._common import PageDep, read_json, require_id, stream_content, v1_router
from gateway.sse import SSE_HEADERS, relay_session_events
from gateway.state import SessionStubDep, StateDep
from gateway.validation import EventsCreateBody, input_events, validate_body

__all__ = ["router"]

router = v1_router()


@router.post("/agents/sessions/{session_id}/events", status_code=202)
async def create_events(
    session_id: str, request: Request, stub: SessionStubDep, idempotency: IdempotencyDep
) -> Response:
    require_id(session_id, "sess")
    body = await read_json(request)
    events = input_events(validate_body(EventsCreateBody, body.data))
    async with idempotency.begin(body.hash) as idem:
        if idem.replay is not None:
            return idem.replay.to_response()
        await stub.SubmitSessionEvents(pb.SubmitSessionEventsRequest(session_id=session_id, events=events))
        # The SDK ignores this body (cast_to=None); 202 means accepted, not done.
        await idem.store(202, "", media_type="application/json")
        return Response(status_code=202)


_INT64_MAX = 2**63 - 1


def _last_event_id(value: str | None) -> int | None:
    """The sequence to resume after, or None for a live subscription. It
    travels as an int64, so a larger one is as invalid as a negative one."""
    if value is None or not value.strip():
        return None
    text = value.strip()
    # ASCII digits only: int() would also take "1_000" and other scripts' digits.
    sequence = int(text) if text.isascii() and text.isdigit() and len(text) <= 19 else -1
    if not 0 <= sequence <= _INT64_MAX:
        raise ApiError(400, "validation_error", "Last-Event-ID must be an event sequence number.", param="Last-Event-ID")
    return sequence


@router.get("/agents/sessions/{session_id}/events")
async def stream_events(
    session_id: str,
    state: StateDep,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
    include_obfuscation: Annotated[bool, Query()] = True,
) -> StreamingResponse:
    require_id(session_id, "sess")
    after = _last_event_id(last_event_id)
    # A unary check first, so an unknown session is a 404 rather than a
    # 200 stream that ends at once. Headers then go out immediately: the SDK
    # submits input only after they arrive.
    current = await state.session.GetSession(pb.GetSessionRequest(session_id=session_id))
    if after is None:
        # No Last-Event-ID: a live subscription from now on, so the SDK's
        # sessions.stream() sees only the turn it is about to submit. The
        # sequence is read before the headers go out and the SDK posts its
        # input only after they arrive, so nothing is missed.
        after = current.session.last_sequence
    events = relay_session_events(
        state.session,
        session_id,
        after_sequence=after,
        keepalive_s=state.settings.sse_keepalive_s,
        closing=state.closing,
        obfuscation=include_obfuscation,
    )
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)


@router.get("/agents/sessions/{session_id}/turns")
async def list_turns(session_id: str, stub: SessionStubDep, page: PageDep) -> dict[str, Any]:
    response = await stub.ListTurns(
        pb.ListTurnsRequest(session_id=require_id(session_id, "sess"), page=page.to_proto())
    )
    return render.cursor_page([render.turn(t) for t in response.turns], response.has_more)


@router.get("/agents/sessions/{session_id}/turns/{turn_id}")
async def retrieve_turn(session_id: str, turn_id: str, stub: SessionStubDep) -> dict[str, Any]:
    response = await stub.GetTurn(
        pb.GetTurnRequest(session_id=require_id(session_id, "sess"), turn_id=require_id(turn_id, "turn"))
    )
    return render.turn(response.turn)


async def _items(stub: SessionStubDep, session_id: str, turn_id: str, page: PageDep) -> dict[str, Any]:
    response = await stub.ListItems(pb.ListItemsRequest(session_id=session_id, turn_id=turn_id, page=page.to_proto()))
    return render.cursor_page([render.item(i) for i in response.items], response.has_more)


@router.get("/agents/sessions/{session_id}/items")
async def list_items(session_id: str, stub: SessionStubDep, page: PageDep) -> dict[str, Any]:
    return await _items(stub, require_id(session_id, "sess"), "", page)


@router.get("/agents/sessions/{session_id}/turns/{turn_id}/items")
async def list_turn_items(session_id: str, turn_id: str, stub: SessionStubDep, page: PageDep) -> dict[str, Any]:
    # Conversation-cursor page: the SDK pages with last_id, which cursor_page sets.
    return await _items(stub, require_id(session_id, "sess"), require_id(turn_id, "turn"), page)


@router.get("/agents/sessions/{session_id}/traces")
async def list_traces(session_id: str, stub: SessionStubDep, page: PageDep) -> dict[str, Any]:
    response = await stub.ListTraces(
        pb.ListTracesRequest(session_id=require_id(session_id, "sess"), page=page.to_proto())
    )
    return render.cursor_page([render.trace(t) for t in response.traces], response.has_more)


@router.get("/agents/sessions/{session_id}/artifacts")
async def list_artifacts(
    session_id: str,
    stub: SessionStubDep,
    page: PageDep,
    environment_id: Annotated[str | None, Query()] = None,
) -> dict[str, Any]:
    response = await stub.ListArtifacts(
        pb.ListArtifactsRequest(session_id=require_id(session_id, "sess"), page=page.to_proto())
    )
    artifacts = [render.artifact(a) for a in response.artifacts]
    if environment_id:
        # A session has one environment, so this keeps the page or empties it.
        artifacts = [a for a in artifacts if a["environment_id"] == environment_id]
    return render.cursor_page(artifacts, response.has_more)


@router.get("/agents/sessions/{session_id}/artifacts/{artifact_id}")
async def retrieve_artifact(session_id: str, artifact_id: str, stub: SessionStubDep) -> dict[str, Any]:
    response = await stub.GetArtifact(
        pb.GetArtifactRequest(session_id=require_id(session_id, "sess"), artifact_id=require_id(artifact_id, "art"))
    )
    return render.artifact(response.artifact)


@router.get("/agents/sessions/{session_id}/artifacts/{artifact_id}/content")
async def artifact_content(session_id: str, artifact_id: str, stub: SessionStubDep) -> StreamingResponse:
    meta = await stub.GetArtifact(
        pb.GetArtifactRequest(session_id=require_id(session_id, "sess"), artifact_id=require_id(artifact_id, "art"))
    )
    media_type = mimetypes.guess_type(meta.artifact.path)[0] or "application/octet-stream"
    call = stub.GetArtifactContent(pb.GetArtifactContentRequest(session_id=session_id, artifact_id=artifact_id))

    return stream_content(call, media_type)


@router.delete("/agents/sessions/{session_id}/artifacts/{artifact_id}")
async def delete_artifact(session_id: str, artifact_id: str, stub: SessionStubDep) -> dict[str, Any]:
    response = await stub.DeleteArtifact(
        pb.DeleteArtifactRequest(session_id=require_id(session_id, "sess"), artifact_id=require_id(artifact_id, "art"))
    )
    return render.deleted(response.artifact_id or artifact_id, "agent.session.artifact.deleted")
