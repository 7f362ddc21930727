"""Thin gRPC adapter of the AutomationService: proto request -> domain call
-> proto response. Domain errors propagate to the server interceptor."""

from __future__ import annotations

from typing import Any

import grpc

from berth.session.v1 import automation_service_pb2 as pb
from berth.session.v1 import automation_service_pb2_grpc
from services.core.context import current_org
from services.session.automations import Automations
from services.session.repository import Page

__all__ = ["AutomationServicer"]


def _page(page: Any) -> Page:
    return Page(limit=page.limit, after=page.after, before=page.before, order=page.order)


class AutomationServicer(automation_service_pb2_grpc.AutomationServiceServicer):
    def __init__(self, automations: Automations) -> None:
        self.automations = automations

    async def CreateAutomation(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.CreateAutomationResponse(automation=await self.automations.create(current_org(), request.automation))

    async def GetAutomation(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.GetAutomationResponse(automation=await self.automations.get(current_org(), request.automation_id))

    async def ListAutomations(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        automations, more = await self.automations.list_automations(current_org(), _page(request.page), request.session_id)
        return pb.ListAutomationsResponse(automations=automations, has_more=more)

    async def UpdateAutomation(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        updated = await self.automations.update(current_org(), request.automation, set(request.update_mask.paths))
        return pb.UpdateAutomationResponse(automation=updated)

    async def DeleteAutomation(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.DeleteAutomationResponse(automation_id=await self.automations.delete(current_org(), request.automation_id))

    async def PauseAutomation(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.PauseAutomationResponse(automation=await self.automations.pause(current_org(), request.automation_id))

    async def ResumeAutomation(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.ResumeAutomationResponse(automation=await self.automations.resume(current_org(), request.automation_id))

    async def CreateInvocation(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        invocation = await self.automations.create_invocation(current_org(), request.automation_id)
        return pb.CreateInvocationResponse(invocation=invocation)

    async def GetInvocation(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        invocation = await self.automations.get_invocation(current_org(), request.automation_id, request.invocation_id)
        return pb.GetInvocationResponse(invocation=invocation)

    async def ListInvocations(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        invocations, more = await self.automations.list_invocations(current_org(), request.automation_id, _page(request.page))
        return pb.ListInvocationsResponse(invocations=invocations, has_more=more)
