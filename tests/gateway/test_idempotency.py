from __future__ import annotations

import grpc
import pytest

from gateway.keys import create_key
from gateway_support import Stack, domain_error

BODY = {"environment": {"type": "openai_hosted", "packages": {"python": ["numpy"]}}}


async def test_same_key_and_body_replays_the_first_response_without_calling_the_service(stack: Stack) -> None:
    async with stack.client() as client:
        first = await client.post("/v1/agents/environments", json=BODY, headers={"Idempotency-Key": "k1"})
        # Same meaning, different key order and spacing.
        again = await client.post(
            "/v1/agents/environments",
            content=b'{"environment":{"packages":{"python":["numpy"]},"type":"openai_hosted"}}',
            headers={"Idempotency-Key": "k1", "Content-Type": "application/json"},
        )
    assert first.status_code == again.status_code == 201
    assert again.json() == first.json()
    assert again.headers["idempotent-replayed"] == "true"
    assert stack.environment.count("CreateEnvironment") == 1


async def test_same_key_with_a_different_body_is_409_idempotency_key_reused(stack: Stack) -> None:
    async with stack.client() as client:
        await client.post("/v1/agents/environments", json=BODY, headers={"Idempotency-Key": "k2"})
        response = await client.post(
            "/v1/agents/environments", json={"environment": {"type": "openai_hosted"}}, headers={"Idempotency-Key": "k2"}
        )
    assert (response.status_code, response.json()["error"]["code"]) == (409, "idempotency_key_reused")
    assert stack.environment.count("CreateEnvironment") == 1


async def test_a_failed_attempt_releases_the_key_for_a_retry(stack: Stack) -> None:
    stack.environment.fail["CreateEnvironment"] = domain_error(grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE")
    async with stack.client() as client:
        failed = await client.post("/v1/agents/environments", json=BODY, headers={"Idempotency-Key": "k3"})
        del stack.environment.fail["CreateEnvironment"]
        retried = await client.post("/v1/agents/environments", json=BODY, headers={"Idempotency-Key": "k3"})
    assert (failed.status_code, retried.status_code) == (503, 201)
    assert stack.environment.count("CreateEnvironment") == 2


@pytest.mark.parametrize(
    ("code", "status"), [(grpc.StatusCode.INTERNAL, 500), (grpc.StatusCode.DEADLINE_EXCEEDED, 504), (grpc.StatusCode.UNKNOWN, 500)]
)
async def test_an_attempt_that_may_have_written_stays_bound_to_its_outcome(
    stack: Stack, code: grpc.StatusCode, status: int
) -> None:
    # The service may have committed before it failed: a retry must not run again.
    stack.environment.fail["CreateEnvironment"] = domain_error(code, "")
    async with stack.client() as client:
        failed = await client.post("/v1/agents/environments", json=BODY, headers={"Idempotency-Key": "k-bound"})
        del stack.environment.fail["CreateEnvironment"]
        retried = await client.post("/v1/agents/environments", json=BODY, headers={"Idempotency-Key": "k-bound"})
    assert (failed.status_code, retried.status_code) == (status, status)
    assert retried.json() == failed.json()
    assert (retried.headers["idempotent-replayed"], retried.headers["x-should-retry"]) == ("true", "false")
    assert stack.environment.count("CreateEnvironment") == 1


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION])
async def test_an_attempt_refused_whole_releases_the_key_for_a_retry(stack: Stack, code: grpc.StatusCode) -> None:
    stack.environment.fail["CreateEnvironment"] = domain_error(code, "")
    async with stack.client() as client:
        refused = await client.post("/v1/agents/environments", json=BODY, headers={"Idempotency-Key": "k-free"})
        del stack.environment.fail["CreateEnvironment"]
        retried = await client.post("/v1/agents/environments", json=BODY, headers={"Idempotency-Key": "k-free"})
    assert 400 <= refused.status_code < 500
    assert retried.status_code == 201
    assert stack.environment.count("CreateEnvironment") == 2


async def test_keys_are_scoped_per_org_and_per_route(stack: Stack) -> None:
    _, other_org_key = await create_key(stack.db, "other", ["tasks:read", "tasks:write"])
    fake = stack.session.add_session(stack.org_id)
    async with stack.client() as client, stack.client(other_org_key) as other:
        await client.post("/v1/agents/environments", json=BODY, headers={"Idempotency-Key": "shared"})
        await other.post("/v1/agents/environments", json=BODY, headers={"Idempotency-Key": "shared"})
        events = await client.post(
            f"/v1/agents/sessions/{fake.session.id}/events",
            json={"events": [{"type": "agent.session.input.cancel"}]},
            headers={"Idempotency-Key": "shared"},
        )
    assert events.status_code == 202
    assert stack.environment.count("CreateEnvironment") == 2


async def test_replayed_event_submission_returns_202_and_submits_once(stack: Stack) -> None:
    fake = stack.session.add_session(stack.org_id)
    body = {"events": [{"type": "agent.session.input.message", "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]}]}
    async with stack.client() as client:
        responses = [
            await client.post(f"/v1/agents/sessions/{fake.session.id}/events", json=body, headers={"Idempotency-Key": "e1"})
            for _ in range(2)
        ]
    assert [r.status_code for r in responses] == [202, 202]
    assert stack.session.count("SubmitSessionEvents") == 1


async def test_overlong_idempotency_key_is_rejected(stack: Stack) -> None:
    async with stack.client() as client:
        response = await client.post("/v1/agents/environments", json=BODY, headers={"Idempotency-Key": "k" * 300})
    assert (response.status_code, response.json()["error"]["param"]) == (400, "Idempotency-Key")
