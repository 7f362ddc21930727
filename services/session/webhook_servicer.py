"""Thin gRPC adapter of the WebhookService: proto -> domain -> proto."""

from __future__ import annotations

import json
from typing import Any

import grpc

from berth.session.v1 import webhook_pb2, webhook_service_pb2, webhook_service_pb2_grpc
from services.core.context import current_org
from services.session.models import WebhookEndpointRow
from services.session.repository import Page
from services.session.views import timestamp
from services.session.webhooks import catalog
from services.session.webhooks.endpoints import DeliveryView, WebhookEndpoints
from services.session.webhooks.states import DeliveryStatus, EndpointStatus

__all__ = ["WebhookServicer"]


def _page(page: Any) -> Page:
    return Page(limit=page.limit, after=page.after, before=page.before, order=page.order)


def _endpoint(row: WebhookEndpointRow) -> webhook_pb2.WebhookEndpoint:
    return webhook_pb2.WebhookEndpoint(
        id=row.id,
        name=row.name,
        url=row.url,
        event_types=json.loads(row.event_types_json),
        signing_secret_hint=row.secret_hint,
        status=EndpointStatus(row.status).to_proto(),
        disabled_reason=row.disabled_reason,
        consecutive_failures=row.consecutive_failures,
        create_time=timestamp(row.created_at),
        update_time=timestamp(row.updated_at),
    )


def _delivery(view: DeliveryView) -> webhook_pb2.WebhookDelivery:
    row = view.row
    status = DeliveryStatus(row.status)
    message = webhook_pb2.WebhookDelivery(
        id=row.id,
        endpoint_id=row.endpoint_id,
        event_id=row.event_id,
        event_type=row.event_type,
        status=status.to_proto(),
        attempt_count=row.attempt_count,
        create_time=timestamp(row.created_at),
        attempts=[
            webhook_pb2.WebhookDeliveryAttempt(
                attempt=a.attempt,
                start_time=timestamp(a.started_at),
                duration_ms=a.duration_ms,
                status_code=a.status_code,
                error=a.error,
                success=a.success,
            )
            for a in view.attempts
        ],
    )
    if status is DeliveryStatus.PENDING:
        message.next_attempt_time.CopyFrom(timestamp(row.next_attempt_at))
    if row.delivered_at is not None:
        message.delivered_time.CopyFrom(timestamp(row.delivered_at))
    return message


class WebhookServicer(webhook_service_pb2_grpc.WebhookServiceServicer):
    def __init__(self, endpoints: WebhookEndpoints) -> None:
        self.endpoints = endpoints

    async def CreateWebhookEndpoint(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        row, secret = await self.endpoints.create(
            current_org(), name=request.name, url=request.url, event_types=list(request.event_types)
        )
        return webhook_service_pb2.CreateWebhookEndpointResponse(endpoint=_endpoint(row), signing_secret=secret)

    async def GetWebhookEndpoint(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        row = await self.endpoints.get(current_org(), request.endpoint_id)
        return webhook_service_pb2.GetWebhookEndpointResponse(endpoint=_endpoint(row))

    async def ListWebhookEndpoints(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        rows, has_more = await self.endpoints.list_endpoints(current_org(), _page(request.page))
        return webhook_service_pb2.ListWebhookEndpointsResponse(endpoints=[_endpoint(r) for r in rows], has_more=has_more)

    async def UpdateWebhookEndpoint(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        row = await self.endpoints.update(
            current_org(),
            request.endpoint_id,
            name=request.name if request.HasField("name") else None,
            url=request.url if request.HasField("url") else None,
            event_types=list(request.event_types.values) if request.HasField("event_types") else None,
        )
        return webhook_service_pb2.UpdateWebhookEndpointResponse(endpoint=_endpoint(row))

    async def DeleteWebhookEndpoint(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self.endpoints.delete(current_org(), request.endpoint_id)
        return webhook_service_pb2.DeleteWebhookEndpointResponse(endpoint_id=request.endpoint_id)

    async def RotateWebhookSecret(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        row, secret = await self.endpoints.rotate_secret(current_org(), request.endpoint_id)
        return webhook_service_pb2.RotateWebhookSecretResponse(endpoint=_endpoint(row), signing_secret=secret)

    async def ListWebhookEventTypes(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return webhook_service_pb2.ListWebhookEventTypesResponse(event_types=list(catalog.EVENT_TYPES))

    async def ListWebhookDeliveries(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        views, has_more = await self.endpoints.deliveries(current_org(), request.endpoint_id, _page(request.page))
        return webhook_service_pb2.ListWebhookDeliveriesResponse(deliveries=[_delivery(v) for v in views], has_more=has_more)
