"""Webhooks through the gateway: endpoints registered with the official SDK
(``client.webhooks``), deliveries signed and verified by a receiver on
127.0.0.1 that is stopped and restarted mid-test, an endpoint disabled after
the failure bound, and who may touch which endpoint."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
from e2e_stack import Stack, destroy_sandboxes, start_stack
from e2e_support import assert_error
from waiting import wait_until
from webhook_support import Receiver

pytestmark = pytest.mark.asyncio(loop_scope="module")

_FAST_RETRIES: dict[str, Any] = {
    "webhook_allow_destinations": ["127.0.0.1/32"],
    "webhook_retry_base_s": 0.05,
    "webhook_retry_max_s": 0.2,
}


@pytest_asyncio.fixture(loop_scope="module")
async def receiver() -> AsyncIterator[Receiver]:
    r = Receiver()
    r.start()
    try:
        yield r
    finally:
        r.stop()


async def _stack(tmp_path: Path, **overrides: Any) -> AsyncIterator[Stack]:
    s, stop = await start_stack(tmp_path / "berth", **{**_FAST_RETRIES, **overrides})
    try:
        yield s
    finally:
        await stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    async for s in _stack(tmp_path_factory.mktemp("webhooks"), webhook_disable_after=1000):
        yield s


_orgs = iter(range(1_000_000))


@pytest_asyncio.fixture(loop_scope="module")
async def stack(shared: Stack) -> Stack:
    """The module's stack, seen by an organization of the test's own."""
    org = f"org-wh{next(_orgs)}"
    key = await shared.new_key(org)

    async def new_key(other: str = "org-b", scopes: tuple[str, ...] = ("tasks:read", "tasks:write")) -> str:
        return await shared.new_key(org if other == "org-a" else f"{org}-{other}", scopes)

    return Stack(settings=shared.settings, base_url=shared.base_url, key=key, database=shared.database, new_key=new_key)


def _strict(stack: Stack, key: str | None = None) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=stack.base_url, api_key=key or stack.key, max_retries=0, _strict_response_validation=True
    )


async def _session(http: httpx.AsyncClient) -> str:
    response = await http.post("/agents/sessions", json={"agent": {"model": "scripted"}, "environment": {"type": "none"}, "input": "hi"})
    assert response.status_code == 200, response.text
    return str(response.json()["id"])


async def _register(stack: Stack, receiver: Receiver, event_types: list[Any]) -> str:
    created = await _strict(stack).webhooks.create(name="hooks", url=receiver.url, event_types=event_types)
    assert created.signing_secret.startswith("whsec_") and created.signing_secret_hint
    receiver.secret = created.signing_secret
    return created.id


async def test_deliveries_survive_a_receiver_restart_signed_and_none_lost(stack: Stack, receiver: Receiver) -> None:
    endpoint_id = await _register(stack, receiver, ["agent.session.created"])
    async with stack.http() as http:
        before = [await _session(http) for _ in range(3)]
        await wait_until(lambda: len(receiver.events("agent.session.created")) >= 3, 30, what="first deliveries")
        receiver.stop()
        during = [await _session(http) for _ in range(3)]

        async def failed_attempts() -> bool:
            page = (await http.get(f"/webhook_endpoints/{endpoint_id}/deliveries")).json()
            pending = [d for d in page["data"] if d["status"] == "pending" and d["attempts"]]
            return len(pending) == 3 and all(not a["success"] and a["error"] for d in pending for a in d["attempts"])

        await wait_until(failed_attempts, 30, what="attempts fail while the receiver is down")
        receiver.start()

        def all_received() -> bool:
            return {e["data"]["id"] for e in receiver.events("agent.session.created")} == set(before + during)

        await wait_until(all_received, 30, what="every session's delivery after the restart")
        deliveries = (await http.get(f"/webhook_endpoints/{endpoint_id}/deliveries")).json()["data"]
    assert receiver.unsigned == []
    assert len(deliveries) == 6 and {d["status"] for d in deliveries} == {"delivered"}
    # webhook-id is the event's ID, the same on every attempt.
    assert all(webhook_id == event["id"] for webhook_id, event in receiver.verified)
    event = receiver.events("agent.session.created")[0]
    assert event["object"] == "event" and event["data"]["environment_type"] == "none"


async def test_turn_and_status_events_are_delivered_only_for_subscribed_types(stack: Stack, receiver: Receiver) -> None:
    await _register(stack, receiver, ["agent.session.turn.completed", "agent.session.turn.failed", "agent.session.idle"])
    async with stack.http() as http:
        session_id = await _session(http)

    def turn_ended() -> list[dict[str, Any]]:
        return [
            e
            for kind in ("agent.session.turn.completed", "agent.session.turn.failed")
            for e in receiver.events(kind)
            if e["data"]["session_id"] == session_id
        ]

    (ended,) = await wait_until(turn_ended, 30, what="the turn's end is delivered")
    assert ended["data"]["id"].startswith("turn_")
    # The SDK parses the session status events it knows as its own types.
    idle = await wait_until(lambda: receiver.events("agent.session.idle"), 30, what="the session idles")
    assert idle[0]["data"] == {"id": session_id, "environment_type": "none", "environment_id": None}
    assert receiver.events("agent.session.created") == [] and receiver.unsigned == []


async def test_a_published_artifact_is_announced_with_its_turn(
    stack: Stack, receiver: Receiver, bwrap_available: None
) -> None:
    await _register(stack, receiver, ["agent.session.artifact.created", "agent.session.turn.completed"])
    body = {
        "agent": {"model": "scripted"},
        "environment": {"type": "openai_hosted"},
        "input": "$ echo hooked > $REBYTE_OUTPUT_DIR/report.txt\ndone",
    }
    try:
        async with stack.http() as http:
            response = await http.post("/agents/sessions", json=body)
            assert response.status_code == 200, response.text
            session_id = response.json()["id"]
            (artifact,) = await wait_until(
                lambda: receiver.events("agent.session.artifact.created"), 90, what="the artifact's announcement"
            )
            listed = (await http.get(f"/agents/sessions/{session_id}/artifacts")).json()["data"]
        (completed,) = await wait_until(lambda: receiver.events("agent.session.turn.completed"), 30, what="the turn")
    finally:
        await destroy_sandboxes(stack.data_dir)
    assert artifact["data"]["id"] == listed[0]["id"] and artifact["data"]["session_id"] == session_id
    assert artifact["data"]["turn_id"] == completed["data"]["id"] and artifact["data"]["path"].endswith("report.txt")


async def test_endpoint_is_disabled_after_the_failure_bound(tmp_path: Path, receiver: Receiver) -> None:
    # A stack of its own: the bound is a setting.
    async for stack in _stack(tmp_path, webhook_disable_after=3):
        receiver.status = 500
        endpoint_id = await _register(stack, receiver, ["agent.session.created"])
        client = _strict(stack)
        async with stack.http() as http:
            await _session(http)

            async def disabled() -> bool:
                endpoint = (await http.get(f"/webhook_endpoints/{endpoint_id}")).json()
                return bool(endpoint["status"] == "disabled")

            await wait_until(disabled, 30, what="the endpoint is disabled")
            deliveries = (await http.get(f"/webhook_endpoints/{endpoint_id}/deliveries")).json()["data"]
            assert [d["status"] for d in deliveries] == ["failed"]
            assert [a["status_code"] for a in deliveries[0]["attempts"]] == [500, 500, 500]
            # A disabled endpoint gets nothing new.
            await _session(http)
            assert len((await http.get(f"/webhook_endpoints/{endpoint_id}/deliveries")).json()["data"]) == 1
        endpoint = await client.webhooks.retrieve(endpoint_id)
        assert endpoint.model_extra and endpoint.model_extra["disabled_reason"]


async def test_endpoints_round_trip_through_the_sdk(stack: Stack, receiver: Receiver) -> None:
    client = _strict(stack)
    created = await client.webhooks.create(name="a", url=receiver.url, event_types=["agent.session.created"])
    assert created.url == receiver.url and created.event_types == ["agent.session.created"]
    fetched = await client.webhooks.retrieve(created.id)
    assert fetched.signing_secret_hint == created.signing_secret_hint and "signing_secret" not in (fetched.model_extra or {})
    updated = await client.webhooks.update(created.id, name="b", event_types=["agent.session.idle", "agent.environment.ready"])
    assert updated.name == "b" and updated.event_types == ["agent.session.idle", "agent.environment.ready"]
    listed = [e.id async for e in client.webhooks.list()]
    assert listed == [created.id]
    rotated = await client.webhooks.rotate_secret(created.id)
    assert rotated.signing_secret != created.signing_secret
    types = await client.webhooks.event_types.list()
    assert "agent.session.created" in types.data and "agent.automation.invocation.completed" in types.data
    deleted = await client.webhooks.delete(created.id)
    assert deleted.deleted and deleted.id == created.id
    assert (await _api_error(client.webhooks.retrieve(created.id))).status_code == 404


async def _api_error(call: Any) -> openai.APIStatusError:
    try:
        await call
    except openai.APIStatusError as exc:
        return exc
    raise AssertionError("the call succeeded")


_BAD_BODIES: list[tuple[dict[str, Any], str]] = [
    ({"name": "x", "url": "http://127.0.0.1:1/h", "event_types": ["no.such.type"]}, "event_types"),
    ({"name": "x", "url": "http://127.0.0.1:1/h", "event_types": []}, "event_types"),
    ({"name": "x", "url": "https://10.0.0.5/h", "event_types": ["agent.session.idle"]}, "url"),
    ({"name": "x", "url": "https://169.254.169.254/latest", "event_types": ["agent.session.idle"]}, "url"),
    ({"name": "x", "url": "https://[::1]/h", "event_types": ["agent.session.idle"]}, "url"),
    ({"name": "x", "url": "https://localhost/h", "event_types": ["agent.session.idle"]}, "url"),
    ({"name": "x", "url": "http://example.com/h", "event_types": ["agent.session.idle"]}, "url"),
    ({"name": "x", "url": "ftp://example.com/h", "event_types": ["agent.session.idle"]}, "url"),
    ({"name": "x", "url": "https://u:p@example.com/h", "event_types": ["agent.session.idle"]}, "url"),
    ({"name": " ", "url": "https://example.com/h", "event_types": ["agent.session.idle"]}, "name"),
    ({"url": "https://example.com/h", "event_types": ["agent.session.idle"]}, "name"),
    ({"name": "x", "url": "https://example.com/h", "event_types": ["agent.session.idle"], "extra": 1}, "extra"),
]


async def test_bad_endpoint_input_is_a_400_naming_the_param_and_writes_nothing(stack: Stack) -> None:
    async with stack.http() as http:
        for body, param in _BAD_BODIES:
            assert_error(await http.post("/webhook_endpoints", json=body), 400, "validation_error", param=param)
        good = {"name": "x", "url": "https://example.com/h", "event_types": ["agent.session.idle"]}
        response = await http.post("/webhook_endpoints", json=good, headers={"Idempotency-Key": "k1"})
        assert_error(response, 400, "validation_error", param="Idempotency-Key")
        assert (await http.get("/webhook_endpoints")).json()["data"] == []


async def test_rotate_keeping_the_old_secret_is_refused(stack: Stack, receiver: Receiver) -> None:
    endpoint_id = await _register(stack, receiver, ["agent.session.idle"])
    async with stack.http() as http:
        response = await http.post(
            f"/webhook_endpoints/{endpoint_id}/rotate_secret", json={"keep_old_secret_active_for_24_hours": True}
        )
    assert_error(response, 400, "validation_error", param="keep_old_secret_active_for_24_hours")


_ID_ROUTES = [
    ("GET", "/webhook_endpoints/{id}", None),
    ("POST", "/webhook_endpoints/{id}", {"name": "stolen"}),
    ("DELETE", "/webhook_endpoints/{id}", None),
    ("POST", "/webhook_endpoints/{id}/rotate_secret", {}),
    ("GET", "/webhook_endpoints/{id}/deliveries", None),
]


async def test_another_organizations_endpoint_is_404_on_every_route(stack: Stack, receiver: Receiver) -> None:
    endpoint_id = await _register(stack, receiver, ["agent.session.created"])
    other = await stack.new_key("org-b")
    async with stack.http(other) as http:
        for method, template, body in _ID_ROUTES:
            response = await http.request(method, template.format(id=endpoint_id), json=body)
            assert_error(response, 404, "not_found")
        assert (await http.get("/webhook_endpoints")).json()["data"] == []
        # Another organization's sessions never reach this endpoint.
        await _session(http)
    async with stack.http() as http:
        assert (await http.get(f"/webhook_endpoints/{endpoint_id}")).json()["name"] == "hooks"
        assert (await http.get(f"/webhook_endpoints/{endpoint_id}/deliveries")).json()["data"] == []


async def test_scopes_split_webhook_reads_from_writes(stack: Stack, receiver: Receiver) -> None:
    endpoint_id = await _register(stack, receiver, ["agent.session.created"])
    reader = await stack.new_key("org-a", ("tasks:read",))
    writer = await stack.new_key("org-a", ("tasks:write",))
    create = {"name": "x", "url": receiver.url, "event_types": ["agent.session.idle"]}
    async with stack.http(reader) as http:
        for method, template, body in [("POST", "/webhook_endpoints", create), *_ID_ROUTES]:
            if method != "GET":
                assert_error(await http.request(method, template.format(id=endpoint_id), json=body), 403, "insufficient_scopes")
    async with stack.http(writer) as http:
        for template in ["/webhook_endpoints", "/webhook_event_types", "/webhook_endpoints/{id}", "/webhook_endpoints/{id}/deliveries"]:
            assert_error(await http.get(template.format(id=endpoint_id)), 403, "insufficient_scopes")


async def test_an_automation_invocation_is_announced_when_queued_and_when_delivered(stack: Stack, receiver: Receiver) -> None:
    await _register(stack, receiver, ["agent.automation.invocation.queued", "agent.automation.invocation.completed"])
    async with stack.http() as http:
        session_id = await _session(http)
        target = {"type": "existing_session", "session_id": session_id, "instructions": "again"}
        automation = await http.post(
            "/agents/automations",
            json={"type": "periodic", "name": "hooks", "expression": "0 9 * * *", "timezone": "UTC", "target": target},
        )
        assert automation.status_code == 200, automation.text
        invocation = await http.post(f"/agents/automations/{automation.json()['id']}/invocations")
        assert invocation.status_code == 200, invocation.text
    invocation_id = invocation.json()["id"]

    def announced(kind: str) -> list[dict[str, Any]]:
        return [e for e in receiver.events(kind) if e["data"]["id"] == invocation_id]

    (queued,) = await wait_until(lambda: announced("agent.automation.invocation.queued"), 30, what="the queued invocation")
    (completed,) = await wait_until(lambda: announced("agent.automation.invocation.completed"), 30, what="the delivered one")
    assert queued["data"]["automation_id"] == automation.json()["id"] and queued["data"]["status"] == "queued"
    assert completed["data"]["session_id"] == session_id
    assert receiver.unsigned == []
