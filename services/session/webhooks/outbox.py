"""The durable outbox: deliveries are written in the transaction of the
event they announce, so an event is announced if and only if it commits.

``capture`` runs inside every ``Store.transact`` unit (services/session/store.py):
it picks the log events that announce a webhook event and enqueues them for
the subscribed endpoints of the session's organization. The turn's
publication calls ``announce_artifacts``; ``enqueue`` is the same for any
other producer (automation invocations): call it with the unit that writes
the event. Both wake the
delivery worker with ``WEBHOOKS_KEY`` (LISTEN/NOTIFY on PostgreSQL).
"""

from __future__ import annotations

import json
import time
from typing import Any, cast

from sqlalchemy import Table, and_, bindparam, insert, select

from services.core.ids import new_id
from services.session.models import ArtifactRow, SessionRow, WebhookDeliveryRow, WebhookEndpointRow
from services.session.store import Unit
from services.session.webhooks import catalog
from services.session.webhooks.states import DeliveryStatus, EndpointStatus

__all__ = ["WEBHOOKS_KEY", "capture", "enqueue", "announce_artifacts"]

# The wake-up key of the delivery workers.
WEBHOOKS_KEY = "webhooks"

_DELIVERIES = cast(Table, WebhookDeliveryRow.__table__)
_INSERT_DELIVERIES = insert(_DELIVERIES)
# On the path of every transaction that ends a turn or changes a session's
# status: built once (docs/CONVENTIONS.md), the session IDs bound at execute time.
_SESSION_ENDPOINTS = (
    select(
        SessionRow.id,
        SessionRow.org_id,
        SessionRow.environment_kind,
        SessionRow.environment_id,
        WebhookEndpointRow.id,
        WebhookEndpointRow.event_types_json,
    )
    .select_from(SessionRow)
    .join(
        WebhookEndpointRow,
        and_(
            WebhookEndpointRow.org_id == SessionRow.org_id,
            WebhookEndpointRow.status == EndpointStatus.ENABLED.value,
        ),
    )
    .where(SessionRow.id.in_(bindparam("session_ids", expanding=True)))
)


def _subscribed(rows: list[tuple[str, str]], event_type: str) -> list[str]:
    return [endpoint_id for endpoint_id, types_json in rows if event_type in json.loads(types_json)]


def _delivery_rows(org: str, endpoints: list[tuple[str, str]], events: list[catalog.WebhookEvent]) -> list[dict[str, Any]]:
    now = time.time()
    rows: list[dict[str, Any]] = []
    for event in events:
        payload = json.dumps(catalog.envelope(event, now), separators=(",", ":"))
        for endpoint_id in _subscribed(endpoints, event.type):
            rows.append(
                {
                    "id": new_id("whdel"),
                    "org_id": org,
                    "endpoint_id": endpoint_id,
                    "event_id": event.id,
                    "event_type": event.type,
                    "payload_json": payload,
                    "status": DeliveryStatus.PENDING.value,
                    "attempt_count": 0,
                    "next_attempt_at": now,
                    "claimed_by": "",
                    "created_at": now,
                    "delivered_at": None,
                }
            )
    return rows


async def _write(unit: Unit, org: str, endpoints: list[tuple[str, str]], events: list[catalog.WebhookEvent]) -> int:
    rows = _delivery_rows(org, endpoints, events)
    if rows:
        await unit.session.execute(_INSERT_DELIVERIES, rows)
        unit.wake_key(WEBHOOKS_KEY)
    return len(rows)


async def _enabled_endpoints(unit: Unit, org: str) -> list[tuple[str, str]]:
    result = await unit.session.execute(
        select(WebhookEndpointRow.id, WebhookEndpointRow.event_types_json).where(
            WebhookEndpointRow.org_id == org, WebhookEndpointRow.status == EndpointStatus.ENABLED.value
        )
    )
    return [(row[0], row[1]) for row in result.all()]


async def enqueue(unit: Unit, org: str, event_type: str, data: dict[str, Any], *, event_id: str = "") -> int:
    """Enqueues one event for the organization's enabled endpoints that
    subscribe to ``event_type``, in ``unit``'s transaction; returns the
    number of deliveries written."""
    if event_type not in catalog.EVENT_TYPES:
        raise ValueError(f"unknown webhook event type {event_type!r}")
    event = catalog.WebhookEvent(event_id or new_id("evt"), event_type, data)
    return await _write(unit, org, await _enabled_endpoints(unit, org), [event])


async def announce_artifacts(unit: Unit, org: str, artifacts: list[ArtifactRow]) -> int:
    """Enqueues ``agent.session.artifact.created`` for artifacts published in ``unit``."""
    if not artifacts:
        return 0
    events = [
        catalog.artifact_created(
            new_id("evt"),
            artifact_id=a.id,
            session_id=a.session_id,
            turn_id=a.turn_id,
            path=a.path,
            size_bytes=a.size_bytes,
        )
        for a in artifacts
    ]
    return await _write(unit, org, await _enabled_endpoints(unit, org), events)


async def capture(unit: Unit) -> None:
    """Enqueues the webhook events of the log events ``unit`` appended."""
    appended = [(sid, ev) for sid, ev in unit.appended if ev.type in catalog.SESSION_EVENT_TYPES]
    if not appended:
        return
    session_ids = sorted({sid for sid, _ in appended})
    # One read: each session's facts with its organization's enabled endpoints.
    result = await unit.session.execute(_SESSION_ENDPOINTS, {"session_ids": session_ids})
    facts: dict[str, tuple[str, catalog.SessionFacts]] = {}
    endpoints: dict[str, list[tuple[str, str]]] = {}
    for sid, org, env_kind, env_id, endpoint_id, types_json in result.all():
        facts[sid] = (org, catalog.SessionFacts(sid, env_kind, env_id))
        endpoints.setdefault(sid, []).append((endpoint_id, types_json))
    by_session: dict[str, list[catalog.WebhookEvent]] = {}
    for sid, appended_event in appended:
        if sid in facts:
            event = catalog.from_session_event(appended_event.event, facts[sid][1])
            if event is not None:
                by_session.setdefault(sid, []).append(event)
    for sid, events in by_session.items():
        await _write(unit, facts[sid][0], endpoints[sid], events)
