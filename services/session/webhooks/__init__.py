"""Webhooks of the Session service: endpoints registered per organization,
a durable outbox written in the transaction of each event it announces,
and a worker that delivers it signed (Standard Webhooks)."""

from services.session.webhooks.catalog import EVENT_TYPES
from services.session.webhooks.outbox import WEBHOOKS_KEY, announce_artifacts, capture, enqueue

__all__ = ["EVENT_TYPES", "WEBHOOKS_KEY", "announce_artifacts", "capture", "enqueue"]
