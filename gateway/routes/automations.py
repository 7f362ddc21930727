"""Automations: ``/v1/agents/automations`` and their invocations (update is a
POST, as the SDK sends it). Included before ``/v1/agents/{agent_id}``, so
these paths never read as an agent ID."""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import Query, Request
from fastapi.responses import Response

from berth.session.v1 import automation_service_pb2 as pb
from gateway import render
from gateway.automation_requests import automation_create, automation_update
from gateway.idempotency import IdempotencyDep
from gateway.render_automations import automation, invocation
from gateway.routes._common import PageDep, json_response, read_json, require_id, v1_router
from gateway.state import AutomationStubDep

__all__ = ["router"]

router = v1_router()

_PREFIX = "auto"


@router.post("/agents/automations")
async def create_automation(request: Request, stub: AutomationStubDep, idempotency: IdempotencyDep) -> Response:
    body = await read_json(request)
    message = automation_create(body.data)
    async with idempotency.begin(body.hash) as idem:
        if idem.replay is not None:
            return idem.replay.to_response()
        response = await stub.CreateAutomation(pb.CreateAutomationRequest(automation=message))
        content = automation(response.automation)
        await idem.store(200, json.dumps(content))
        return json_response(content)


@router.get("/agents/automations")
async def list_automations(
    stub: AutomationStubDep, page: PageDep, session_id: Annotated[str | None, Query()] = None
) -> dict[str, Any]:
    if session_id is not None:
        require_id(session_id, "sess")
    response = await stub.ListAutomations(pb.ListAutomationsRequest(page=page.to_proto(), session_id=session_id or ""))
    return render.cursor_page([automation(a) for a in response.automations], response.has_more)


@router.get("/agents/automations/{automation_id}")
async def retrieve_automation(automation_id: str, stub: AutomationStubDep) -> dict[str, Any]:
    response = await stub.GetAutomation(pb.GetAutomationRequest(automation_id=require_id(automation_id, _PREFIX)))
    return automation(response.automation)


@router.post("/agents/automations/{automation_id}")
async def update_automation(automation_id: str, request: Request, stub: AutomationStubDep) -> dict[str, Any]:
    require_id(automation_id, _PREFIX)
    message, paths = automation_update(automation_id, (await read_json(request)).data)
    response = await stub.UpdateAutomation(
        pb.UpdateAutomationRequest(automation=message, update_mask={"paths": paths})
    )
    return automation(response.automation)


@router.delete("/agents/automations/{automation_id}")
async def delete_automation(automation_id: str, stub: AutomationStubDep) -> dict[str, Any]:
    response = await stub.DeleteAutomation(pb.DeleteAutomationRequest(automation_id=require_id(automation_id, _PREFIX)))
    return render.deleted(response.automation_id or automation_id, "agent.automation.deleted")


@router.post("/agents/automations/{automation_id}/pause")
async def pause_automation(automation_id: str, stub: AutomationStubDep) -> dict[str, Any]:
    response = await stub.PauseAutomation(pb.PauseAutomationRequest(automation_id=require_id(automation_id, _PREFIX)))
    return automation(response.automation)


@router.post("/agents/automations/{automation_id}/resume")
async def resume_automation(automation_id: str, stub: AutomationStubDep) -> dict[str, Any]:
    response = await stub.ResumeAutomation(pb.ResumeAutomationRequest(automation_id=require_id(automation_id, _PREFIX)))
    return automation(response.automation)


@router.post("/agents/automations/{automation_id}/invocations")
async def create_invocation(automation_id: str, stub: AutomationStubDep, idempotency: IdempotencyDep) -> Response:
    require_id(automation_id, _PREFIX)
    async with idempotency.begin(automation_id) as idem:
        if idem.replay is not None:
            return idem.replay.to_response()
        response = await stub.CreateInvocation(pb.CreateInvocationRequest(automation_id=automation_id))
        content = invocation(response.invocation)
        await idem.store(200, json.dumps(content))
        return json_response(content)


@router.get("/agents/automations/{automation_id}/invocations")
async def list_invocations(automation_id: str, stub: AutomationStubDep, page: PageDep) -> dict[str, Any]:
    response = await stub.ListInvocations(
        pb.ListInvocationsRequest(automation_id=require_id(automation_id, _PREFIX), page=page.to_proto())
    )
    return render.cursor_page([invocation(i) for i in response.invocations], response.has_more)


@router.get("/agents/automations/{automation_id}/invocations/{invocation_id}")
async def retrieve_invocation(automation_id: str, invocation_id: str, stub: AutomationStubDep) -> dict[str, Any]:
    response = await stub.GetInvocation(
        pb.GetInvocationRequest(
            automation_id=require_id(automation_id, _PREFIX), invocation_id=require_id(invocation_id, "ainv")
        )
    )
    return invocation(response.invocation)
