"""Saved agents: ``/v1/agents`` (update is a POST, as the SDK sends it)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from berth.session.v1 import session_service_pb2 as pb
from gateway import render
from gateway.convert import create_agent_request, update_agent_request
from gateway.idempotency import IdempotencyDep
from gateway.routes._common import v1_router, PageDep, json_response, read_json, require_id
from gateway.state import SessionStubDep
from gateway.validation import AgentCreateBody, AgentUpdateBody, validate_body

__all__ = ["router"]

router = v1_router()


@router.post("/agents")
async def create_agent(request: Request, stub: SessionStubDep, idempotency: IdempotencyDep) -> Response:
    body = await read_json(request)
    message = create_agent_request(validate_body(AgentCreateBody, body.data))
    async with idempotency.begin(body.hash) as idem:
        if idem.replay is not None:
            return idem.replay.to_response()
        response = await stub.CreateAgent(message)
        content = render.agent(response.agent)
        await idem.store(200, json.dumps(content))
        return json_response(content)


@router.get("/agents")
async def list_agents(stub: SessionStubDep, page: PageDep) -> dict[str, Any]:
    response = await stub.ListAgents(pb.ListAgentsRequest(page=page.to_proto()))
    return render.cursor_page([render.agent(a) for a in response.agents], response.has_more)


@router.get("/agents/{agent_id}")
async def retrieve_agent(agent_id: str, stub: SessionStubDep) -> dict[str, Any]:
    response = await stub.GetAgent(pb.GetAgentRequest(agent_id=require_id(agent_id, "agent")))
    return render.agent(response.agent)


@router.post("/agents/{agent_id}")
async def update_agent(agent_id: str, request: Request, stub: SessionStubDep) -> dict[str, Any]:
    require_id(agent_id, "agent")
    body = await read_json(request)
    response = await stub.UpdateAgent(update_agent_request(agent_id, validate_body(AgentUpdateBody, body.data)))
    return render.agent(response.agent)


@router.delete("/agents/{agent_id}")
async def delete_agent(agent_id: str, stub: SessionStubDep) -> dict[str, Any]:
    response = await stub.DeleteAgent(pb.DeleteAgentRequest(agent_id=require_id(agent_id, "agent")))
    return render.deleted(response.agent_id or agent_id, "agent.deleted")
