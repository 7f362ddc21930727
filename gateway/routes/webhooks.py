"""Webhook endpoints: ``/v1/webhook_endpoints`` as ``client.webhooks``
sends them (create, list, retrieve, update as a POST, delete,
rotate_secret), ``/v1/webhook_event_types``, and Berth's
``/v1/webhook_endpoints/{id}/deliveries`` with each delivery's attempts."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from berth.session.v1 import webhook_pb2, webhook_service_pb2 as pb
from gateway import render
from gateway.errors import ApiError
from gateway.idempotency import IDEMPOTENCY_HEADER
from gateway.routes._common import PageDep, read_json, require_id, v1_router
from gateway.state import WebhookStubDep
from gateway.validation import (
    WebhookEndpointCreateBody,
    WebhookEndpointUpdateBody,
    WebhookRotateSecretBody,
    validate_body,
)

__all__ = ["router"]

router = v1_router()

_ENDPOINT_STATUS = {
    webhook_pb2.WEBHOOK_ENDPOINT_STATUS_ENABLED: "enabled",
    webhook_pb2.WEBHOOK_ENDPOINT_STATUS_DISABLED: "disabled",
}
_DELIVERY_STATUS = {
    webhook_pb2.WEBHOOK_DELIVERY_STATUS_PENDING: "pending",
    webhook_pb2.WEBHOOK_DELIVERY_STATUS_DELIVERED: "delivered",
    webhook_pb2.WEBHOOK_DELIVERY_STATUS_FAILED: "failed",
}


def _endpoint(e: webhook_pb2.WebhookEndpoint, secret: str = "") -> dict[str, Any]:
    """The SDK's ``WebhookEndpoint`` (``WebhookEndpointWithSecret`` with the
    secret), plus the additive ``status``, ``disabled_reason`` and
    ``consecutive_failures``."""
    out: dict[str, Any] = {
        "id": e.id,
        "object": "webhook_endpoint",
        "name": e.name,
        "url": e.url,
        "event_types": list(e.event_types),
        "signing_secret_hint": e.signing_secret_hint,
        "created_at": render.seconds(e.create_time),
        "updated_at": render.seconds(e.update_time),
        "status": _ENDPOINT_STATUS.get(e.status, "enabled"),
        "disabled_reason": e.disabled_reason or None,
        "consecutive_failures": e.consecutive_failures,
    }
    if secret:
        out["signing_secret"] = secret
    return out


def _delivery(d: webhook_pb2.WebhookDelivery) -> dict[str, Any]:
    return {
        "id": d.id,
        "object": "webhook_endpoint.delivery",
        "webhook_endpoint_id": d.endpoint_id,
        "event_id": d.event_id,
        "event_type": d.event_type,
        "status": _DELIVERY_STATUS.get(d.status, "pending"),
        "attempt_count": d.attempt_count,
        "created_at": render.seconds(d.create_time),
        "next_attempt_at": render.seconds(d.next_attempt_time) if d.HasField("next_attempt_time") else None,
        "delivered_at": render.seconds(d.delivered_time) if d.HasField("delivered_time") else None,
        "attempts": [
            {
                "attempt": a.attempt,
                "started_at": render.seconds(a.start_time),
                "duration_ms": round(a.duration_ms, 3),
                "status_code": a.status_code or None,
                "error": a.error or None,
                "success": a.success,
            }
            for a in d.attempts
        ],
    }


@router.post("/webhook_endpoints")
async def create_webhook_endpoint(request: Request, stub: WebhookStubDep) -> dict[str, Any]:
    if IDEMPOTENCY_HEADER in request.headers:
        # A replay would need the signing secret stored with the response: refused, not ignored.
        raise ApiError(400, "validation_error", "Idempotency-Key is not supported here.", param="Idempotency-Key")
    body = validate_body(WebhookEndpointCreateBody, (await read_json(request)).data)
    response = await stub.CreateWebhookEndpoint(
        pb.CreateWebhookEndpointRequest(name=body.name, url=body.url, event_types=body.event_types)
    )
    return _endpoint(response.endpoint, response.signing_secret)


@router.get("/webhook_endpoints")
async def list_webhook_endpoints(stub: WebhookStubDep, page: PageDep) -> dict[str, Any]:
    response = await stub.ListWebhookEndpoints(pb.ListWebhookEndpointsRequest(page=page.to_proto()))
    return render.cursor_page([_endpoint(e) for e in response.endpoints], response.has_more)


@router.get("/webhook_endpoints/{webhook_endpoint_id}")
async def retrieve_webhook_endpoint(webhook_endpoint_id: str, stub: WebhookStubDep) -> dict[str, Any]:
    request = pb.GetWebhookEndpointRequest(endpoint_id=require_id(webhook_endpoint_id, "we"))
    return _endpoint((await stub.GetWebhookEndpoint(request)).endpoint)


@router.post("/webhook_endpoints/{webhook_endpoint_id}")
async def update_webhook_endpoint(webhook_endpoint_id: str, request: Request, stub: WebhookStubDep) -> dict[str, Any]:
    require_id(webhook_endpoint_id, "we")
    body = validate_body(WebhookEndpointUpdateBody, (await read_json(request)).data)
    message = pb.UpdateWebhookEndpointRequest(endpoint_id=webhook_endpoint_id, name=body.name, url=body.url)
    if body.event_types is not None:
        message.event_types.values.extend(body.event_types)
    return _endpoint((await stub.UpdateWebhookEndpoint(message)).endpoint)


@router.delete("/webhook_endpoints/{webhook_endpoint_id}")
async def delete_webhook_endpoint(webhook_endpoint_id: str, stub: WebhookStubDep) -> dict[str, Any]:
    request = pb.DeleteWebhookEndpointRequest(endpoint_id=require_id(webhook_endpoint_id, "we"))
    await stub.DeleteWebhookEndpoint(request)
    return render.deleted(webhook_endpoint_id, "webhook_endpoint.deleted")


@router.post("/webhook_endpoints/{webhook_endpoint_id}/rotate_secret")
async def rotate_webhook_secret(webhook_endpoint_id: str, request: Request, stub: WebhookStubDep) -> dict[str, Any]:
    require_id(webhook_endpoint_id, "we")
    raw = await request.body()
    validate_body(WebhookRotateSecretBody, (await read_json(request)).data if raw.strip() else {})
    response = await stub.RotateWebhookSecret(pb.RotateWebhookSecretRequest(endpoint_id=webhook_endpoint_id))
    return _endpoint(response.endpoint, response.signing_secret)


@router.get("/webhook_endpoints/{webhook_endpoint_id}/deliveries")
async def list_webhook_deliveries(webhook_endpoint_id: str, stub: WebhookStubDep, page: PageDep) -> dict[str, Any]:
    request = pb.ListWebhookDeliveriesRequest(endpoint_id=require_id(webhook_endpoint_id, "we"), page=page.to_proto())
    response = await stub.ListWebhookDeliveries(request)
    return render.cursor_page([_delivery(d) for d in response.deliveries], response.has_more)


@router.get("/webhook_event_types")
async def list_webhook_event_types(stub: WebhookStubDep) -> dict[str, Any]:
    response = await stub.ListWebhookEventTypes(pb.ListWebhookEventTypesRequest())
    return {"object": "list", "data": list(response.event_types)}
