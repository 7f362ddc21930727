from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from gateway_support import Stack, domain_error
from services.core.errors import NotFound


@pytest.mark.parametrize(
    ("code", "reason", "status", "error_code"),
    [
        (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED", 401, "invalid_api_key"),
        # The gateway's internal credentials refused: a misconfiguration, not the caller's key.
        (grpc.StatusCode.UNAUTHENTICATED, "PEER_UNAUTHENTICATED", 500, "internal_error"),
        (grpc.StatusCode.PERMISSION_DENIED, "PEER_NOT_ALLOWED", 500, "internal_error"),
        (grpc.StatusCode.PERMISSION_DENIED, "INSUFFICIENT_SCOPES", 403, "insufficient_scopes"),
        (grpc.StatusCode.NOT_FOUND, "NOT_FOUND", 404, "not_found"),
        (grpc.StatusCode.INVALID_ARGUMENT, "VALIDATION_ERROR", 400, "validation_error"),
        (grpc.StatusCode.INVALID_ARGUMENT, "PATH_OUTSIDE_WORKSPACE", 400, "validation_error"),
        (grpc.StatusCode.FAILED_PRECONDITION, "ENVIRONMENT_IN_USE", 409, "environment_in_use"),
        (grpc.StatusCode.FAILED_PRECONDITION, "INITIALIZATION_RUNNING", 409, "environment_initializing"),
        (grpc.StatusCode.FAILED_PRECONDITION, "SESSION_ACTIVE", 409, "session_in_progress"),
        (grpc.StatusCode.FAILED_PRECONDITION, "ENVIRONMENT_FAILED", 409, "environment_failed"),
        (grpc.StatusCode.FAILED_PRECONDITION, "MCP_SERVER_DEAD", 409, "mcp_server_dead"),
        (grpc.StatusCode.FAILED_PRECONDITION, "FAILED_PRECONDITION", 409, "conflict"),
        (grpc.StatusCode.ALREADY_EXISTS, "CONFLICT", 409, "conflict"),
        (grpc.StatusCode.UNAVAILABLE, "SANDBOX_UNAVAILABLE", 503, "sandbox_unavailable"),
        (grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE", 503, "service_unavailable"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "", 504, "timeout"),
        (grpc.StatusCode.INTERNAL, "INTERNAL", 500, "internal_error"),
        (grpc.StatusCode.DATA_LOSS, "", 500, "internal_error"),
    ],
)
async def test_service_failure_maps_to_http_status_and_error_code(
    stack: Stack, code: grpc.StatusCode, reason: str, status: int, error_code: str
) -> None:
    stack.environment.fail["DeleteEnvironment"] = domain_error(code, reason)
    env = stack.environment.add_environment(stack.org_id)
    async with stack.client() as client:
        response = await client.delete(f"/v1/agents/environments/{env.id}")
    assert response.status_code == status
    error = response.json()["error"]
    assert error["code"] == error_code
    assert set(error) == {"message", "type", "param", "code"}


async def test_validation_error_from_the_service_carries_its_param(stack: Stack) -> None:
    stack.environment.fail["CreateEnvironment"] = domain_error(
        grpc.StatusCode.INVALID_ARGUMENT, "VALIDATION_ERROR", param="environment.packages.python.0"
    )
    async with stack.client() as client:
        response = await client.post("/v1/agents/environments", json={"environment": {"type": "openai_hosted"}})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "environment.packages.python.0"


async def test_non_transient_conflicts_tell_the_sdk_not_to_retry(stack: Stack) -> None:
    stack.environment.fail["DeleteEnvironment"] = domain_error(grpc.StatusCode.FAILED_PRECONDITION, "ENVIRONMENT_IN_USE")
    env = stack.environment.add_environment(stack.org_id)
    async with stack.client() as client:
        response = await client.delete(f"/v1/agents/environments/{env.id}")
    assert response.headers["x-should-retry"] == "false"


async def test_not_found_from_the_service_is_a_404_envelope(stack: Stack) -> None:
    stack.session.fail["GetSession"] = NotFound("no such session")
    async with stack.client() as client:
        response = await client.get("/v1/agents/sessions/sess_0000000000000000000000000")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"


async def test_unknown_route_and_wrong_method_use_the_envelope(stack: Stack) -> None:
    async with stack.client() as client:
        missing = await client.get("/v1/agents/nothing/here/at/all")
        unrouted = await client.get("/nope")
        wrong_method = await client.put("/v1/agents/environments")
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "not_found")
    assert (unrouted.status_code, unrouted.json()["error"]["code"]) == (404, "not_found")
    assert (wrong_method.status_code, wrong_method.json()["error"]["code"]) == (405, "method_not_allowed")


async def test_malformed_id_is_404_without_asking_the_service(stack: Stack) -> None:
    async with stack.client() as client:
        response = await client.get("/v1/agents/environments/not-an-id")
    assert (response.status_code, response.json()["error"]["code"]) == (404, "not_found")
    assert stack.environment.count("GetEnvironment") == 0


async def test_malformed_json_is_400_invalid_json(stack: Stack) -> None:
    async with stack.client() as client:
        response = await client.post(
            "/v1/agents/environments", content=b'{"environment": ', headers={"Content-Type": "application/json"}
        )
    assert (response.status_code, response.json()["error"]["code"]) == (400, "invalid_json")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"environment": {"type": "openai_hosted", "files": [{"type": "inline", "path": "/etc/x", "data": "aGk="}]}},
            "environment.files.0.path",
        ),
        (
            {"environment": {"type": "openai_hosted", "files": [{"type": "inline", "path": "/workspace/../x", "data": "aGk="}]}},
            "environment.files.0.path",
        ),
        ({"environment": {"type": "openai_hosted", "packages": {"python": "numpy"}}}, "environment.packages.python"),
        ({"environment": {"type": "self_made"}}, "environment.type"),
        ({"environment": {"type": "openai_hosted", "setup_command": []}}, "environment.setup_command"),
        ({"environment": {"type": "openai_hosted", "files": [{"type": "blob", "path": "/workspace/a"}]}}, "environment.files.0.type"),
        ({}, "environment"),
    ],
)
async def test_invalid_environment_body_is_400_with_dotted_param(stack: Stack, body: dict[str, object], param: str) -> None:
    async with stack.client() as client:
        response = await client.post("/v1/agents/environments", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("validation_error", param, "invalid_request_error")
    assert stack.environment.count("CreateEnvironment") == 0


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"environment": {"type": "none"}, "agent": {"model": "m"}}, "input"),
        ({"environment": {"type": "none"}, "input": "hi"}, "agent.model"),
        ({"environment": {"type": "none"}, "agent": {"model": 3}, "input": "hi"}, "agent.model"),
        ({"environment": {"type": "reference"}, "agent": {"model": "m"}}, "environment.environment_id"),
        (
            {"environment": {"type": "none"}, "agent": {"model": "m"}, "input": [{"role": "user", "content": [{"type": "input_text", "text": 1}]}]},
            "input.0.content.0.text",
        ),
        (
            {"environment": {"type": "openai_hosted", "environment_id": "env_x", "files": []}, "agent": {"model": "m"}},
            "environment.files",
        ),
    ],
)
async def test_invalid_session_body_is_400_with_dotted_param(stack: Stack, body: dict[str, object], param: str) -> None:
    async with stack.client() as client:
        response = await client.post("/v1/agents/sessions", json=body)
    assert response.status_code == 400
    assert (response.json()["error"]["code"], response.json()["error"]["param"]) == ("validation_error", param)


async def test_unknown_input_event_type_is_rejected(stack: Stack) -> None:
    fake = stack.session.add_session(stack.org_id)
    async with stack.client() as client:
        response = await client.post(
            f"/v1/agents/sessions/{fake.session.id}/events", json={"events": [{"type": "agent.session.input.steer"}]}
        )
    assert (response.status_code, response.json()["error"]["param"]) == (400, "events.0.type")


async def test_query_parameter_out_of_range_is_400_with_param(stack: Stack) -> None:
    async with stack.client() as client:
        response = await client.get("/v1/agents/sessions", params={"limit": 1000})
    assert (response.status_code, response.json()["error"]["param"]) == (400, "limit")


async def test_body_over_the_declared_limit_is_413(stack: Stack) -> None:
    async with stack.client() as client:
        response = await client.post(
            "/v1/agents/environments",
            content=b"x" * (stack.settings.max_body_bytes + 1),
            headers={"Content-Type": "application/json"},
        )
    assert (response.status_code, response.json()["error"]["code"]) == (413, "request_too_large")


async def test_streamed_body_over_the_limit_is_413_without_content_length(stack: Stack) -> None:
    chunk = b" " * 8192

    async def body() -> AsyncIterator[bytes]:
        for _ in range(stack.settings.max_body_bytes // len(chunk) + 2):
            yield chunk

    async with stack.client() as client:
        response = await client.post("/v1/agents/environments", content=body(), headers={"Content-Type": "application/json"})
    assert (response.status_code, response.json()["error"]["code"]) == (413, "request_too_large")
    assert stack.environment.count("CreateEnvironment") == 0
