"""The webhook outbox and its workers on one database, as two replicas:
deliveries written in the transaction of their events, none lost while no
worker runs, each claimed and delivered once across the replicas, and
workers woken by commits rather than polling (their idle poll is an hour)."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.fernet import Fernet
from session_support import add_idle_session
from sqlalchemy import select
from waiting import wait_until
from webhook_support import Receiver

from services.core.db import Database, open_database
from services.core.errors import InvalidArgument
from services.core.key_ring import KeyRing
from services.core.notify import Notifier, open_notifier
from services.core.settings import normalize_database_url
from services.session.models import WebhookAttemptRow, WebhookDeliveryRow
from services.session.store import Store, Unit
from services.session.webhooks import announce_artifacts, capture, enqueue
from services.session.webhooks.delivery import DeliveryConfig, WebhookDeliverer, backoff_s
from services.session.webhooks.destinations import DestinationPolicy, DestinationRefused
from services.session.webhooks.endpoints import WebhookEndpoints
from services.session.webhooks.signing import SecretBox

_MIGRATIONS = Path(__file__).parents[2] / "services" / "session" / "migrations" / "versions"
_ORG = "org_a"
_CONFIG = DeliveryConfig(
    timeout_s=5, retry_base_s=0.05, retry_max_s=0.2, disable_after=1000, concurrency=4, claim_s=30, idle_poll_s=3600
)


class _Replica:
    def __init__(self, db: Database, notifier: Notifier, deliverer: WebhookDeliverer) -> None:
        self.db, self.notifier, self.deliverer = db, notifier, deliverer
        self.store = Store(db, notifier, before_commit=capture)


@pytest.fixture
async def replicas(database_url: str) -> AsyncIterator[list[_Replica]]:
    box = SecretBox(KeyRing([Fernet.generate_key()]))
    out: list[_Replica] = []
    for _ in range(2):
        db = await open_database(normalize_database_url(database_url), "session", _MIGRATIONS)
        notifier = open_notifier(db, channel="berth_webhooks_test", safety_poll_s=3600)
        await notifier.start()
        policy = DestinationPolicy(["127.0.0.1/32"])
        out.append(_Replica(db, notifier, WebhookDeliverer(db, notifier, box, policy, _CONFIG)))
    try:
        yield out
    finally:
        for replica in out:
            await replica.deliverer.close()
            await replica.notifier.close()
            await replica.db.dispose()


async def _add_session(u: Unit, session_id: str) -> None:
    await add_idle_session(u, session_id, _ORG)


async def test_each_delivery_is_claimed_once_across_replicas_and_none_is_lost_while_no_worker_runs(
    replicas: list[_Replica],
) -> None:
    a, b = replicas
    receiver = Receiver()
    receiver.start()
    try:
        endpoints = WebhookEndpoints(a.store, a.deliverer.box, a.deliverer.policy)
        types = ["agent.automation.invocation.completed", "agent.session.idle"]
        _, receiver.secret = await endpoints.create(_ORG, name="r", url=receiver.url, event_types=types)

        async def enqueue_one(u: Unit, n: int) -> None:
            await enqueue(u, _ORG, "agent.automation.invocation.completed", {"id": f"inv_{n}"})

        # No worker runs yet: the outbox holds them.
        for n in range(10):
            await a.store.transact(functools.partial(enqueue_one, n=n))
        await a.store.transact(lambda u: _add_session(u, "sess_wh"))
        await a.deliverer.start()
        await b.deliverer.start()
        # Enqueued on A while both run: A is woken in process, B by NOTIFY (or not at all on SQLite).
        for n in range(10, 20):
            await a.store.transact(functools.partial(enqueue_one, n=n))

        async def rows(s: object) -> list[WebhookDeliveryRow]:
            return list((await s.execute(select(WebhookDeliveryRow))).scalars())  # type: ignore[attr-defined]

        async def all_delivered() -> list[WebhookDeliveryRow] | None:
            found = await a.store.query(rows)
            return found if len(found) == 21 and all(d.status == "delivered" for d in found) else None

        delivered = await wait_until(all_delivered, 30, what="every delivery recorded")
        attempts = await a.store.query(lambda s: _attempts(s))
    finally:
        receiver.stop()
    assert len(delivered) == 21 and {d.status for d in delivered} == {"delivered"}
    # Claimed once each: one attempt per delivery, and no webhook-id twice.
    assert sorted(d.attempt_count for d in delivered) == [1] * 21 and len(attempts) == 21
    ids = [webhook_id for webhook_id, _ in receiver.verified]
    assert len(ids) == len(set(ids)) == 21 and receiver.unsigned == []
    idle = [event for _, event in receiver.verified if event["type"] == "agent.session.idle"]
    assert [e["data"]["id"] for e in idle] == ["sess_wh"]
    invocations = {e["data"]["id"] for _, e in receiver.verified if e["type"] == "agent.automation.invocation.completed"}
    assert invocations == {f"inv_{n}" for n in range(20)}


async def _attempts(s: object) -> list[WebhookAttemptRow]:
    return list((await s.execute(select(WebhookAttemptRow))).scalars())  # type: ignore[attr-defined]


async def test_an_event_rolled_back_is_never_delivered(replicas: list[_Replica]) -> None:
    a, _ = replicas
    endpoints = WebhookEndpoints(a.store, a.deliverer.box, a.deliverer.policy)
    await endpoints.create(_ORG, name="r", url="http://127.0.0.1:9/h", event_types=["agent.session.idle"])

    async def fails(u: Unit) -> None:
        await _add_session(u, "sess_rolled_back")
        raise RuntimeError("the unit fails after its event")

    with pytest.raises(RuntimeError):
        await a.store.transact(fails)
    assert await a.store.query(lambda s: _deliveries(s)) == []


async def _deliveries(s: object) -> list[dict[str, Any]]:
    return [json.loads(p) for p in (await s.execute(select(WebhookDeliveryRow.payload_json))).scalars()]  # type: ignore[attr-defined]


def test_backoff_grows_exponentially_with_jitter_and_is_capped() -> None:
    assert backoff_s(1, 1.0, 60.0, rand=lambda: 0.0) == 0.5
    assert backoff_s(1, 1.0, 60.0, rand=lambda: 1.0) == 1.0
    assert backoff_s(4, 1.0, 60.0, rand=lambda: 0.0) == 4.0
    assert backoff_s(40, 1.0, 60.0, rand=lambda: 1.0) == 60.0


@pytest.mark.parametrize(
    "url",
    [
        "https://127.0.0.1/h", "https://10.1.2.3/h", "https://192.168.0.1/h", "https://172.16.0.1/h",
        "https://169.254.169.254/h", "https://100.64.0.1/h", "https://[::1]/h", "https://[fe80::1]/h",
        "https://[::ffff:127.0.0.1]/h", "https://0.0.0.0/h", "https://localhost/h", "https://a.localhost/h",
        "http://example.com/h", "https://example.com:0/h", "file:///etc/passwd",
        # Spellings the resolver turns into loopback, and IPv6 forms that embed it.
        "https://127.1/h", "https://0x7f000001/h", "https://2130706433/h",
        "https://[2002:7f00:1::]/h", "https://[64:ff9b::7f00:1]/h",
    ],
)
def test_control_plane_and_private_destinations_are_refused_by_default(url: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        DestinationPolicy([]).check_url(url)
    assert refused.value.param == "url"


def test_listed_destinations_are_allowed() -> None:
    policy = DestinationPolicy(["127.0.0.1/32", "hooks.internal"])
    assert policy.check_url("http://127.0.0.1:8080/h")
    assert policy.check_url("http://hooks.internal/h")
    with pytest.raises(InvalidArgument):
        policy.check_url("https://127.0.0.2/h")


async def test_a_name_resolving_to_a_refused_address_is_refused_at_delivery() -> None:
    with pytest.raises(DestinationRefused):
        await DestinationPolicy([]).resolve("https://localhost/h")
    target = await DestinationPolicy(["localhost"]).resolve("http://localhost:1/h")
    assert target.host == "localhost" and target.address in ("127.0.0.1", "::1")


async def test_an_artifact_published_with_a_turn_is_announced_in_its_transaction(replicas: list[_Replica]) -> None:
    from services.session.models import ArtifactRow

    a, _ = replicas
    endpoints = WebhookEndpoints(a.store, a.deliverer.box, a.deliverer.policy)
    await endpoints.create(_ORG, name="r", url="http://127.0.0.1:9/h", event_types=["agent.session.artifact.created"])

    async def publish(u: Unit) -> None:
        await _add_session(u, "sess_art")
        artifact = ArtifactRow(
            id="art_1", org_id=_ORG, session_id="sess_art", turn_id="turn_1", environment_id="env_1",
            path="outputs/report.md", size_bytes=5, sha256="0" * 64, created_at=time.time(),
        )
        u.session.add(artifact)
        await announce_artifacts(u, _ORG, [artifact])

    await a.store.transact(publish)
    (payload,) = await a.store.query(lambda s: _deliveries(s))
    assert payload["type"] == "agent.session.artifact.created" and payload["object"] == "event"
    assert payload["data"] == {
        "id": "art_1", "session_id": "sess_art", "turn_id": "turn_1", "path": "outputs/report.md", "size_bytes": 5
    }
