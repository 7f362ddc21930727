"""Webhook endpoints of an organization: register, change, delete, rotate
the secret, and list deliveries. Every query is scoped by organization;
another organization's endpoint is ``NotFound``."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from sqlalchemy import delete, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from services.core.errors import InvalidArgument, NotFound
from services.core.ids import new_id
from services.session import repository as repo
from services.session.models import WebhookAttemptRow, WebhookDeliveryRow, WebhookEndpointRow
from services.session.repository import Page
from services.session.store import Store, Unit
from services.session.webhooks import catalog
from services.session.webhooks.destinations import DestinationPolicy
from services.session.webhooks.signing import SecretBox, new_secret, secret_hint
from services.session.webhooks.states import DeliveryStatus, EndpointStatus

__all__ = ["WebhookEndpoints", "DeliveryView"]

_MAX_NAME = 256


@dataclass(frozen=True)
class DeliveryView:
    row: WebhookDeliveryRow
    attempts: list[WebhookAttemptRow]


def _name(value: str) -> str:
    if not value.strip() or len(value) > _MAX_NAME:
        raise InvalidArgument(f"name must be 1 to {_MAX_NAME} characters", param="name")
    return value


def _event_types(values: list[str]) -> list[str]:
    if not values:
        raise InvalidArgument("event_types must name at least one event type", param="event_types")
    unknown = [v for v in values if v not in catalog.EVENT_TYPES]
    if unknown:
        raise InvalidArgument(f"unknown event type {unknown[0]!r}", param="event_types")
    return list(dict.fromkeys(values))


class WebhookEndpoints:
    def __init__(self, store: Store, box: SecretBox, policy: DestinationPolicy) -> None:
        self.store = store
        self.box = box
        self.policy = policy

    async def create(self, org: str, *, name: str, url: str, event_types: list[str]) -> tuple[WebhookEndpointRow, str]:
        """The new endpoint and its signing secret (returned this once)."""
        secret = new_secret()
        now = time.time()
        row = WebhookEndpointRow(
            id=new_id("we"),
            org_id=org,
            name=_name(name),
            url=self.policy.check_url(url),
            event_types_json=json.dumps(_event_types(event_types)),
            secret_encrypted=self.box.seal(secret),
            secret_hint=secret_hint(secret),
            status=EndpointStatus.ENABLED.value,
            disabled_reason="",
            consecutive_failures=0,
            created_at=now,
            updated_at=now,
        )

        async def run(u: Unit) -> None:
            u.session.add(row)

        await self.store.transact(run)
        return row, secret

    async def get(self, org: str, endpoint_id: str) -> WebhookEndpointRow:
        return await self.store.query(lambda s: _endpoint(s, org, endpoint_id))

    async def list_endpoints(self, org: str, page: Page) -> tuple[list[WebhookEndpointRow], bool]:
        return await self.store.query(lambda s: repo.paginate(s, WebhookEndpointRow, [WebhookEndpointRow.org_id == org], page))

    async def update(
        self, org: str, endpoint_id: str, *, name: str | None, url: str | None, event_types: list[str] | None
    ) -> WebhookEndpointRow:
        changes: dict[str, object] = {}
        if name is not None:
            changes["name"] = _name(name)
        if url is not None:
            changes["url"] = self.policy.check_url(url)
        if event_types is not None:
            changes["event_types_json"] = json.dumps(_event_types(event_types))

        async def run(u: Unit) -> WebhookEndpointRow:
            row = await _endpoint(u.session, org, endpoint_id)
            changed = {k: v for k, v in changes.items() if getattr(row, k) != v}
            if changed:
                for key, value in changed.items():
                    setattr(row, key, value)
                row.updated_at = time.time()
            return row

        return await self.store.transact(run)

    async def rotate_secret(self, org: str, endpoint_id: str) -> tuple[WebhookEndpointRow, str]:
        secret = new_secret()

        async def run(u: Unit) -> WebhookEndpointRow:
            row = await _endpoint(u.session, org, endpoint_id)
            row.secret_encrypted = self.box.seal(secret)
            row.secret_hint = secret_hint(secret)
            row.updated_at = time.time()
            return row

        return await self.store.transact(run), secret

    async def delete(self, org: str, endpoint_id: str) -> None:
        """Deletes the endpoint; its pending deliveries are given up (kept as failed)."""

        async def run(u: Unit) -> None:
            await _endpoint(u.session, org, endpoint_id)
            await u.session.execute(delete(WebhookEndpointRow).where(WebhookEndpointRow.id == endpoint_id))
            await u.session.execute(
                update(WebhookDeliveryRow)
                .where(WebhookDeliveryRow.endpoint_id == endpoint_id, WebhookDeliveryRow.status == DeliveryStatus.PENDING.value)
                .values(status=DeliveryStatus.FAILED.value)
            )

        await self.store.transact(run)

    async def deliveries(self, org: str, endpoint_id: str, page: Page) -> tuple[list[DeliveryView], bool]:
        async def run(s: AsyncSession) -> tuple[list[DeliveryView], bool]:
            await _endpoint(s, org, endpoint_id)
            scope = [WebhookDeliveryRow.endpoint_id == endpoint_id, WebhookDeliveryRow.org_id == org]
            rows, has_more = await repo.paginate(s, WebhookDeliveryRow, scope, page)
            attempts: dict[str, list[WebhookAttemptRow]] = {}
            if rows:
                found = await s.execute(
                    select(WebhookAttemptRow)
                    .where(WebhookAttemptRow.delivery_id.in_([r.id for r in rows]))
                    .order_by(WebhookAttemptRow.pk)
                )
                for attempt in found.scalars():
                    attempts.setdefault(attempt.delivery_id, []).append(attempt)
            return [DeliveryView(r, attempts.get(r.id, [])) for r in rows], has_more

        return await self.store.query(run)


async def _endpoint(s: AsyncSession, org: str, endpoint_id: str) -> WebhookEndpointRow:
    row = (
        await s.execute(select(WebhookEndpointRow).where(WebhookEndpointRow.id == endpoint_id, WebhookEndpointRow.org_id == org))
    ).scalar_one_or_none()
    if row is None:
        raise NotFound(f"webhook endpoint {endpoint_id} not found")
    return row
