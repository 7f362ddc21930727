"""The lifecycles of webhook endpoints and deliveries, and their proto enums."""

from __future__ import annotations

from enum import StrEnum

from berth.session.v1 import webhook_pb2

__all__ = ["EndpointStatus", "DeliveryStatus"]


class EndpointStatus(StrEnum):
    ENABLED = "enabled"
    DISABLED = "disabled"

    def to_proto(self) -> webhook_pb2.WebhookEndpointStatus.ValueType:
        return _ENDPOINT[self]


class DeliveryStatus(StrEnum):
    PENDING = "pending"
    DELIVERED = "delivered"
    FAILED = "failed"

    def to_proto(self) -> webhook_pb2.WebhookDeliveryStatus.ValueType:
        return _DELIVERY[self]


_ENDPOINT = {
    EndpointStatus.ENABLED: webhook_pb2.WEBHOOK_ENDPOINT_STATUS_ENABLED,
    EndpointStatus.DISABLED: webhook_pb2.WEBHOOK_ENDPOINT_STATUS_DISABLED,
}
_DELIVERY = {
    DeliveryStatus.PENDING: webhook_pb2.WEBHOOK_DELIVERY_STATUS_PENDING,
    DeliveryStatus.DELIVERED: webhook_pb2.WEBHOOK_DELIVERY_STATUS_DELIVERED,
    DeliveryStatus.FAILED: webhook_pb2.WEBHOOK_DELIVERY_STATUS_FAILED,
}
