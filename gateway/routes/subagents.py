"""The subagents of a session (``sessions.subagents``): each is read from
the Session service, and its items and turns are those of its child
session (its turns say they belong to the root session, which owns the
subagent)."""

from __future__ import annotations

from typing import Any

from berth.session.v1 import session_service_pb2 as pb
from gateway import render
from gateway.routes._common import PageDep, require_id, v1_router
from gateway.state import SessionStubDep

__all__ = ["router"]

router = v1_router()


def _turn(turn: Any, session_id: str) -> dict[str, Any]:
    """A subagent's turn, owned (as the subagent is) by the root session."""
    out = render.turn(turn)
    out["session_id"] = session_id
    return out


async def _subagent(stub: SessionStubDep, session_id: str, subagent_id: str) -> Any:
    request = pb.GetSubagentRequest(session_id=require_id(session_id, "sess"), subagent_id=require_id(subagent_id, "subagent"))
    return (await stub.GetSubagent(request)).subagent


@router.get("/agents/sessions/{session_id}/subagents")
async def list_subagents(session_id: str, stub: SessionStubDep, page: PageDep) -> dict[str, Any]:
    response = await stub.ListSubagents(
        pb.ListSubagentsRequest(session_id=require_id(session_id, "sess"), page=page.to_proto())
    )
    return render.cursor_page([render.subagent(s) for s in response.subagents], response.has_more)


@router.get("/agents/sessions/{session_id}/subagents/{subagent_id}")
async def retrieve_subagent(session_id: str, subagent_id: str, stub: SessionStubDep) -> dict[str, Any]:
    return render.subagent(await _subagent(stub, session_id, subagent_id))


@router.get("/agents/sessions/{session_id}/subagents/{subagent_id}/items")
async def list_subagent_items(session_id: str, subagent_id: str, stub: SessionStubDep, page: PageDep) -> dict[str, Any]:
    child = (await _subagent(stub, session_id, subagent_id)).child_session_id
    response = await stub.ListItems(pb.ListItemsRequest(session_id=child, page=page.to_proto()))
    return render.cursor_page([render.item(i) for i in response.items], response.has_more)


@router.get("/agents/sessions/{session_id}/subagents/{subagent_id}/turns")
async def list_subagent_turns(session_id: str, subagent_id: str, stub: SessionStubDep, page: PageDep) -> dict[str, Any]:
    child = (await _subagent(stub, session_id, subagent_id)).child_session_id
    response = await stub.ListTurns(pb.ListTurnsRequest(session_id=child, page=page.to_proto()))
    return render.cursor_page([_turn(t, session_id) for t in response.turns], response.has_more)


@router.get("/agents/sessions/{session_id}/subagents/{subagent_id}/turns/{turn_id}")
async def retrieve_subagent_turn(session_id: str, subagent_id: str, turn_id: str, stub: SessionStubDep) -> dict[str, Any]:
    child = (await _subagent(stub, session_id, subagent_id)).child_session_id
    response = await stub.GetTurn(pb.GetTurnRequest(session_id=child, turn_id=require_id(turn_id, "turn")))
    return _turn(response.turn, session_id)


@router.get("/agents/sessions/{session_id}/subagents/{subagent_id}/turns/{turn_id}/items")
async def list_subagent_turn_items(
    session_id: str, subagent_id: str, turn_id: str, stub: SessionStubDep, page: PageDep
) -> dict[str, Any]:
    child = (await _subagent(stub, session_id, subagent_id)).child_session_id
    response = await stub.ListItems(
        pb.ListItemsRequest(session_id=child, turn_id=require_id(turn_id, "turn"), page=page.to_proto())
    )
    return render.cursor_page([render.item(i) for i in response.items], response.has_more)
