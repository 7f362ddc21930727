"""The delivery worker: claims due deliveries from the outbox, POSTs them
signed, and records each attempt.

Claiming is exclusive across replicas: on PostgreSQL the due rows are locked
with ``FOR UPDATE SKIP LOCKED`` (replicas claim disjoint rows without
waiting on each other); on SQLite the write lock serializes claims. A claim
moves ``next_attempt_at`` past the claim lease and names the worker, and
every later write is fenced on that name: a worker that died mid-attempt
loses its claim when the lease ends, and the delivery is attempted again
(at least once; receivers deduplicate by ``webhook-id``, the event ID).
A failed attempt is retried after an exponential backoff with jitter; an
endpoint is disabled after ``webhook_disable_after`` consecutive failed
attempts and its pending deliveries are given up. The worker sleeps until
the next due attempt or a wake-up (``WEBHOOKS_KEY``: a commit that enqueued,
heard through LISTEN/NOTIFY from other replicas).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import httpx
from sqlalchemy import Table, bindparam, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from services.core.db import Database
from services.core.ids import new_id
from services.core.logging import get_logger
from services.core.notify import Notifier
from services.core.settings import Settings
from services.core.events import wait_set
from services.session.models import WebhookAttemptRow, WebhookDeliveryRow, WebhookEndpointRow
from services.session.webhooks.destinations import DestinationPolicy, DestinationRefused
from services.session.webhooks.outbox import WEBHOOKS_KEY
from services.session.webhooks.signing import SecretBox, signed_headers
from services.session.webhooks.states import DeliveryStatus, EndpointStatus

__all__ = ["WebhookDeliverer", "DeliveryConfig", "backoff_s"]

log = get_logger(__name__)

_DELIVERIES = cast(Table, WebhookDeliveryRow.__table__)
_ENDPOINTS = cast(Table, WebhookEndpointRow.__table__)
_ATTEMPTS = cast(Table, WebhookAttemptRow.__table__)
_PENDING = DeliveryStatus.PENDING.value
_ENABLED = EndpointStatus.ENABLED.value

# Built once (see services/session/repository.py on prepared statements).
_DUE = (
    select(_DELIVERIES.c.id)
    .select_from(_DELIVERIES.join(_ENDPOINTS, _ENDPOINTS.c.id == _DELIVERIES.c.endpoint_id))
    .where(
        _DELIVERIES.c.status == _PENDING,
        _DELIVERIES.c.next_attempt_at <= bindparam("now"),
        _ENDPOINTS.c.status == _ENABLED,
    )
    .order_by(_DELIVERIES.c.next_attempt_at)
    .limit(bindparam("limit"))
    .with_for_update(skip_locked=True, of=_DELIVERIES)
)
_CLAIM = (
    update(_DELIVERIES)
    .where(
        _DELIVERIES.c.id.in_(bindparam("ids", expanding=True)),
        _DELIVERIES.c.status == _PENDING,
        _DELIVERIES.c.next_attempt_at <= bindparam("now"),
    )
    .values(
        claimed_by=bindparam("worker"),
        next_attempt_at=bindparam("lease_until"),
        attempt_count=_DELIVERIES.c.attempt_count + 1,
    )
    .returning(
        _DELIVERIES.c.id, _DELIVERIES.c.endpoint_id, _DELIVERIES.c.event_id, _DELIVERIES.c.payload_json,
        _DELIVERIES.c.attempt_count,
    )
)
_NEXT_DUE = (
    select(func.min(_DELIVERIES.c.next_attempt_at))
    .select_from(_DELIVERIES.join(_ENDPOINTS, _ENDPOINTS.c.id == _DELIVERIES.c.endpoint_id))
    .where(_DELIVERIES.c.status == _PENDING, _ENDPOINTS.c.status == _ENABLED)
)
_FENCE = (_DELIVERIES.c.id == bindparam("delivery_id")) & (_DELIVERIES.c.claimed_by == bindparam("worker"))
_DELIVERED = (
    update(_DELIVERIES).where(_FENCE).values(status=DeliveryStatus.DELIVERED.value, delivered_at=bindparam("now"), claimed_by="")
)
_RETRY = update(_DELIVERIES).where(_FENCE).values(next_attempt_at=bindparam("retry_at"), claimed_by="")
_INSERT_ATTEMPT = insert(_ATTEMPTS)
_ENDPOINT_OK = update(_ENDPOINTS).where(_ENDPOINTS.c.id == bindparam("v_endpoint_id")).values(consecutive_failures=0)
_ENDPOINT_FAILED = (
    update(_ENDPOINTS)
    .where(_ENDPOINTS.c.id == bindparam("v_endpoint_id"))
    .values(consecutive_failures=_ENDPOINTS.c.consecutive_failures + 1)
    .returning(_ENDPOINTS.c.consecutive_failures)
)
_DISABLE = (
    update(_ENDPOINTS)
    .where(_ENDPOINTS.c.id == bindparam("v_endpoint_id"), _ENDPOINTS.c.status == _ENABLED)
    .values(status=EndpointStatus.DISABLED.value, disabled_reason=bindparam("reason"))
)
_GIVE_UP = (
    update(_DELIVERIES)
    .where(_DELIVERIES.c.endpoint_id == bindparam("v_endpoint_id"), _DELIVERIES.c.status == _PENDING)
    .values(status=DeliveryStatus.FAILED.value, claimed_by="")
)

_MAX_ERROR = 500


@dataclass(frozen=True)
class DeliveryConfig:
    timeout_s: float
    retry_base_s: float
    retry_max_s: float
    disable_after: int
    concurrency: int
    claim_s: float
    # How long the worker sleeps without a wake-up when nothing is due.
    idle_poll_s: float = 5.0

    @classmethod
    def from_settings(cls, settings: Settings) -> DeliveryConfig:
        return cls(
            timeout_s=settings.webhook_timeout_s,
            retry_base_s=settings.webhook_retry_base_s,
            retry_max_s=settings.webhook_retry_max_s,
            disable_after=settings.webhook_disable_after,
            concurrency=settings.webhook_concurrency,
            claim_s=max(settings.webhook_claim_s, settings.webhook_timeout_s * 2),
        )


def backoff_s(attempt: int, base_s: float, max_s: float, rand: Callable[[], float] = random.random) -> float:
    """Exponential in the attempt number, capped, with jitter over its upper
    half (so retries of many deliveries spread out but never hammer)."""
    ceiling = min(max_s, base_s * 2.0 ** min(attempt - 1, 62))
    return ceiling / 2 + rand() * ceiling / 2


@dataclass(frozen=True)
class _Claimed:
    delivery_id: str
    endpoint_id: str
    event_id: str
    payload: bytes
    attempt: int
    url: str
    secret_sealed: str


@dataclass(frozen=True)
class _Outcome:
    status_code: int
    error: str

    @property
    def success(self) -> bool:
        return 200 <= self.status_code < 300 and not self.error


class WebhookDeliverer:
    def __init__(
        self,
        db: Database,
        notifier: Notifier,
        box: SecretBox,
        policy: DestinationPolicy,
        config: DeliveryConfig,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.db = db
        self.notifier = notifier
        self.box = box
        self.policy = policy
        self.config = config
        self.clock = clock
        self.worker_id = new_id("whw")
        self._wake = notifier.subscribe(WEBHOOKS_KEY)
        self._task: asyncio.Task[None] | None = None
        self._inflight: set[asyncio.Task[None]] = set()
        self._http = httpx.AsyncClient(follow_redirects=False, trust_env=False, timeout=config.timeout_s)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="webhook-deliverer")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for task in list(self._inflight):
            task.cancel()
        if self._inflight:
            await asyncio.wait(set(self._inflight))
        self.notifier.unsubscribe(WEBHOOKS_KEY, self._wake)
        await self._http.aclose()

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            try:
                if len(self._inflight) >= self.config.concurrency:
                    # Busy: a finishing delivery wakes the loop.
                    wait_s = self.config.idle_poll_s
                elif await self._claim_and_start():
                    wait_s = 0.0
                else:
                    wait_s = await self._idle_wait_s()
            except Exception:
                log.exception("webhook_claim_failed")
                wait_s = 1.0
            if wait_s > 0:
                await wait_set(self._wake, wait_s)

    async def _claim_and_start(self) -> bool:
        """Claims what is due, up to the free slots; whether it took them all."""
        free = self.config.concurrency - len(self._inflight)
        batch = await self.db.run(lambda s: self._claim(s, free))
        for claimed in batch:
            task = asyncio.create_task(self._deliver(claimed), name=f"webhook-{claimed.delivery_id}")
            self._inflight.add(task)
            task.add_done_callback(self._finished)
        # A full batch: more may be due right away.
        return len(batch) == free

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._inflight.discard(task)
        # A freed slot may take a due delivery.
        self._wake.set()

    async def _idle_wait_s(self) -> float:
        fallback = float(self.notifier.poll_s(self.config.idle_poll_s))
        next_due = await self.db.run(lambda s: _scalar(s, _NEXT_DUE, {}), read_only=True)
        if next_due is None:
            return fallback
        # Not less than a few milliseconds: what is due but was not claimed
        # is locked by another replica's claim, which takes it at once.
        return float(max(0.005, min(fallback, float(next_due) - self.clock())))

    async def _claim(self, s: AsyncSession, limit: int) -> list[_Claimed]:
        now = self.clock()
        ids = list((await s.execute(_DUE, {"now": now, "limit": limit})).scalars())
        if not ids:
            return []
        params = {"ids": ids, "now": now, "worker": self.worker_id, "lease_until": now + self.config.claim_s}
        rows = (await s.execute(_CLAIM, params)).all()
        if not rows:
            return []
        endpoints = {
            row.id: row
            for row in (
                await s.execute(
                    select(_ENDPOINTS.c.id, _ENDPOINTS.c.url, _ENDPOINTS.c.secret_encrypted).where(
                        _ENDPOINTS.c.id.in_({r.endpoint_id for r in rows})
                    )
                )
            ).all()
        }
        return [
            _Claimed(
                r.id, r.endpoint_id, r.event_id, r.payload_json.encode(), r.attempt_count,
                endpoints[r.endpoint_id].url, endpoints[r.endpoint_id].secret_encrypted,
            )
            for r in rows
            if r.endpoint_id in endpoints
        ]

    async def _deliver(self, claimed: _Claimed) -> None:
        started = self.clock()
        clock_start = time.monotonic()
        outcome = await self._attempt(claimed)
        duration_ms = (time.monotonic() - clock_start) * 1000
        try:
            await self.db.run(lambda s: self._record(s, claimed, outcome, started, duration_ms))
        except Exception:
            # The claim lease ends and the delivery is attempted again.
            log.exception("webhook_record_failed", delivery_id=claimed.delivery_id)
            return
        log.info(
            "webhook_attempted",
            delivery_id=claimed.delivery_id,
            endpoint_id=claimed.endpoint_id,
            attempt=claimed.attempt,
            status_code=outcome.status_code,
            success=outcome.success,
            duration_ms=round(duration_ms, 2),
        )

    async def _attempt(self, claimed: _Claimed) -> _Outcome:
        try:
            target = await self.policy.resolve(claimed.url)
        except DestinationRefused as exc:
            return _Outcome(0, f"destination_refused: {exc}"[:_MAX_ERROR])
        url = httpx.URL(claimed.url)
        headers = {
            "content-type": "application/json",
            "user-agent": "Berth-Webhooks/1",
            "host": url.netloc.decode("ascii"),
            **signed_headers(self.box.open(claimed.secret_sealed), claimed.event_id, int(self.clock()), claimed.payload),
        }
        extensions: dict[str, Any] = {"sni_hostname": target.host} if url.scheme == "https" else {}
        # Connect to the address that was checked, not whatever the name resolves to next.
        pinned = url.copy_with(host=target.address)
        try:
            response = await self._http.post(pinned, content=claimed.payload, headers=headers, extensions=extensions)
        except httpx.HTTPError as exc:
            return _Outcome(0, f"{type(exc).__name__}: {exc}"[:_MAX_ERROR])
        if response.is_redirect:
            return _Outcome(response.status_code, "redirects are not followed")
        return _Outcome(response.status_code, "" if response.is_success else f"HTTP {response.status_code}")

    async def _record(self, s: AsyncSession, claimed: _Claimed, outcome: _Outcome, started: float, duration_ms: float) -> None:
        now = self.clock()
        fence = {"delivery_id": claimed.delivery_id, "worker": self.worker_id}
        if outcome.success:
            result = await s.execute(_DELIVERED, {**fence, "now": now})
        else:
            retry_at = now + backoff_s(claimed.attempt, self.config.retry_base_s, self.config.retry_max_s)
            result = await s.execute(_RETRY, {**fence, "retry_at": retry_at})
        if not result.rowcount:  # type: ignore[attr-defined]
            # The claim lease ended and another worker owns the delivery now.
            return
        await s.execute(
            _INSERT_ATTEMPT,
            [
                {
                    "delivery_id": claimed.delivery_id,
                    "attempt": claimed.attempt,
                    "started_at": started,
                    "duration_ms": duration_ms,
                    "status_code": outcome.status_code,
                    "error": outcome.error,
                    "success": outcome.success,
                }
            ],
        )
        if outcome.success:
            await s.execute(_ENDPOINT_OK, {"v_endpoint_id": claimed.endpoint_id})
            return
        failures = await _scalar(s, _ENDPOINT_FAILED, {"v_endpoint_id": claimed.endpoint_id})
        if failures is not None and int(failures) >= self.config.disable_after:
            reason = f"{int(failures)} consecutive failed delivery attempts"
            disabled = await s.execute(_DISABLE, {"v_endpoint_id": claimed.endpoint_id, "reason": reason})
            if disabled.rowcount:  # type: ignore[attr-defined]
                await s.execute(_GIVE_UP, {"v_endpoint_id": claimed.endpoint_id})
                log.warning("webhook_endpoint_disabled", endpoint_id=claimed.endpoint_id, failures=int(failures))


async def _scalar(s: AsyncSession, statement: Any, params: dict[str, Any]) -> Any:
    return (await s.execute(statement, params)).scalar_one_or_none()
