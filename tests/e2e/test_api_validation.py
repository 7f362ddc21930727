"""Rejected requests: malformed bodies and paths are 400s that name the
offending ``param``, oversized bodies are 413s, and none of them creates
anything. ``Idempotency-Key`` makes environment creation safe to retry."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from e2e_stack import Stack, start_stack
from e2e_support import (
    api_error,
    assert_error,
    b64,
    create_environment,
    delete_environment,
    sandbox_dirs,
)

HOSTED = {"type": "openai_hosted"}
SCRIPTED = {"model": "scripted"}


def _inline(path: str, data: str = b64("x")) -> dict[str, Any]:
    return {"type": "inline", "path": path, "data": data}


async def everything(http: httpx.AsyncClient) -> dict[str, Any]:
    """What exists in the organization."""
    out: dict[str, Any] = {}
    for path in ("/agents/environments", "/agents/sessions", "/agents", "/files"):
        response = await http.get(path, params={"limit": 100})
        assert response.status_code == 200, response.text
        out[path] = [item["id"] for item in response.json()["data"]]
    return out


BAD_PATHS = ["/etc/passwd", "/workspace/../etc/x", "relative.txt", "workspace/a", "/workspace", "/workspacex/a", "/workspace//a", "/workspace/./a"]

ENVIRONMENT_BODIES: list[tuple[str, Any, str]] = [
    ("missing environment", {}, "environment"),
    ("unknown environment type", {"environment": {"type": "kubernetes"}}, "environment.type"),
    ("reference is not a creatable type", {"environment": {"type": "reference", "environment_id": "env_x"}}, "environment.type"),
    ("files is not a list", {"environment": {**HOSTED, "files": "nope"}}, "environment.files"),
    ("unknown file type", {"environment": {**HOSTED, "files": [{"type": "url", "path": "/workspace/a"}]}}, "environment.files.0.type"),
    ("file data is not base64", {"environment": {**HOSTED, "files": [_inline("/workspace/a", "%%%")]}}, "environment.files.0.data"),
    ("setup command is not a string", {"environment": {**HOSTED, "setup_commands": [{"command": 5}]}}, "environment.setup_commands.0.command"),
    ("packages is not an object", {"environment": {**HOSTED, "packages": ["numpy"]}}, "environment.packages"),
    ("unknown network access", {"environment": {**HOSTED, "network": {"access": "sometimes"}}}, "environment.network.access"),
    (
        "blocked domains without restricted access",
        {"environment": {**HOSTED, "network": {"access": "enabled", "blocked_domains": ["example.com"]}}},
        "environment.network.access",
    ),
    (
        "allowed and blocked domains together",
        {"environment": {**HOSTED, "network": {"access": "restricted", "allowed_domains": ["a.com"], "blocked_domains": ["b.com"]}}},
        "environment.network.blocked_domains",
    ),
    (
        "a domain with a path",
        {"environment": {**HOSTED, "network": {"access": "restricted", "allowed_domains": ["a.com/x"]}}},
        "environment.network.allowed_domains",
    ),
    ("unknown container size", {"environment": {**HOSTED, "container_size": "huge"}}, "environment.container_size"),
    ("blank setup command", {"environment": {**HOSTED, "setup_commands": [{"command": "  "}]}}, "environment.setup_commands.0.command"),
    ("unknown top-level field", {"environment": HOSTED, "colour": "blue"}, "colour"),
    ("unknown environment field", {"environment": {**HOSTED, "colour": "blue"}}, "environment.colour"),
    ("vault_ids is not a list", {"environment": HOSTED, "vault_ids": "vault_1"}, "vault_ids"),
    *[
        (f"file path {p!r}", {"environment": {**HOSTED, "files": [_inline("/workspace/ok"), _inline(p)]}}, "environment.files.1.path")
        for p in BAD_PATHS
    ],
]

SESSION_BODIES: list[tuple[str, Any, str]] = [
    ("missing environment", {"agent": SCRIPTED}, "environment"),
    ("unknown environment type", {"agent": SCRIPTED, "environment": {"type": "kubernetes"}}, "environment.type"),
    ("reference without an id", {"agent": SCRIPTED, "environment": {"type": "reference"}}, "environment.environment_id"),
    ("reference with an empty id", {"agent": SCRIPTED, "environment": {"type": "reference", "environment_id": ""}}, "environment.environment_id"),
    (
        "reference overriding setup",
        {"agent": SCRIPTED, "environment": {"type": "reference", "environment_id": "env_x", "setup_commands": [{"command": "true"}]}},
        "environment.setup_commands",
    ),
    (
        "openai_hosted reference overriding files",
        {"agent": SCRIPTED, "environment": {**HOSTED, "environment_id": "env_x", "files": [_inline("/workspace/a")]}},
        "environment.files",
    ),
    ("model is not a string", {"agent": {"model": 123}, "environment": HOSTED}, "agent.model"),
    ("no model and no agent_id", {"agent": {}, "environment": HOSTED}, "agent.model"),
    ("metadata is not an object", {"agent": SCRIPTED, "environment": HOSTED, "metadata": ["a"]}, "metadata"),
    ("inline file outside the workspace", {"agent": SCRIPTED, "environment": {**HOSTED, "files": [_inline("/etc/passwd")]}}, "environment.files.0.path"),
]

FILE_BODIES: list[tuple[str, Any, str]] = [
    *[(f"path {p!r}", _inline(p), "path") for p in BAD_PATHS],
    ("missing path", {"type": "inline", "data": b64("x")}, "path"),
    ("unknown type", {"type": "url", "path": "/workspace/a"}, "type"),
    ("data is not base64", _inline("/workspace/a", "not base64!"), "data"),
    ("data is not a string", {"type": "inline", "path": "/workspace/a", "data": 12}, "data"),
    ("file_id missing", {"type": "file_id", "path": "/workspace/a"}, "file_id"),
]


async def test_malformed_requests_are_rejected_with_their_param_and_create_nothing(stack: Stack) -> None:
    client = stack.aclient()
    env = await create_environment(client)
    async with stack.http() as http:
        before = await everything(http)
        for name, body, param in ENVIRONMENT_BODIES:
            error = assert_error(await http.post("/agents/environments", json=body), 400, "validation_error", param=param)
            assert error["type"] == "invalid_request_error", name
        for name, body, param in SESSION_BODIES:
            response = await http.post("/agents/sessions", json=body)
            assert response.status_code == 400, (name, response.text)
            assert_error(response, 400, "validation_error", param=param)
        for name, body, param in FILE_BODIES:
            response = await http.post(f"/agents/environments/{env.id}/files", json=body)
            assert response.status_code == 400, (name, response.text)
            assert_error(response, 400, "validation_error", param=param)
        for path in ("/etc", "/workspace/../etc", "relative"):
            listed = await http.get(f"/agents/environments/{env.id}/files", params={"path": path})
            assert_error(listed, 400, "validation_error", param="path")
        for params, param in (({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"order": "sideways"}, "order")):
            assert_error(await http.get(f"/agents/environments/{env.id}/files", params=params), 400, "validation_error", param=param)
            assert_error(await http.get("/agents/sessions", params=params), 400, "validation_error", param=param)
        after = await everything(http)

    assert after == before
    # None of the rejected file operations initialized the environment.
    assert (await client.beta.agents.environments.retrieve(env.id)).status == "pending"
    assert not sandbox_dirs(stack.data_dir)


async def test_bodies_that_are_not_json_objects_are_rejected(stack: Stack) -> None:
    async with stack.http() as http:
        before = await everything(http)
        for path in ("/agents/environments", "/agents/sessions", "/agents"):
            malformed = await http.post(path, content=b'{"environment": {"type": ', headers={"content-type": "application/json"})
            assert_error(malformed, 400, "invalid_json")
            assert_error(await http.post(path, json=["not", "an", "object"]), 400, "validation_error")
            assert_error(await http.post(path, json="text"), 400, "validation_error")
        assert await everything(http) == before


async def test_sdk_surfaces_validation_errors_with_their_param(stack: Stack) -> None:
    client = stack.aclient()
    env = await create_environment(client)
    outside = await api_error(
        client.beta.agents.environments.files.create(env.id, type="inline", data=b64("x"), path="/workspace/../etc/x")
    )
    assert isinstance(outside, openai.BadRequestError)
    assert (outside.code, outside.param) == ("validation_error", "path")
    bad_type = await api_error(client.beta.agents.environments.create(environment={"type": "self_hosted"}))  # type: ignore[typeddict-item]
    assert (bad_type.status_code, bad_type.code, bad_type.param) == (400, "validation_error", "environment.type")


async def test_bodies_over_the_size_limit_are_413_and_create_nothing(tmp_path: Path, bwrap_available: None) -> None:
    small, stop = await start_stack(tmp_path / "small", max_body_bytes=4096)
    try:
        client = small.aclient()
        env = await create_environment(client)
        big = b64(b"x" * 8192)
        async with small.http() as http:
            before = await everything(http)
            too_large = [
                await http.post(f"/agents/environments/{env.id}/files", json=_inline("/workspace/big.bin", big)),
                await http.post("/agents/environments", json={"environment": {**HOSTED, "files": [_inline("/workspace/big.bin", big)]}}),
                await http.post(
                    "/agents/sessions",
                    json={"agent": SCRIPTED, "environment": {**HOSTED, "files": [_inline("/workspace/big.bin", big)]}},
                ),
            ]
            for response in too_large:
                assert_error(response, 413, "request_too_large")

            # A chunked body declares no length and is cut off while it streams in.
            async def chunks() -> Any:
                for _ in range(16):
                    yield b" " * 1024

            chunked = await http.post(
                "/agents/environments", content=chunks(), headers={"content-type": "application/json"}
            )
            assert_error(chunked, 413, "request_too_large")
            assert await everything(http) == before

        upload = await api_error(client.files.create(file=("big.bin", b"x" * 8192), purpose="user_data"))
        assert (upload.status_code, upload.code) == (413, "request_too_large")
        async with small.http() as http:
            assert await everything(http) == before
        assert (await client.beta.agents.environments.retrieve(env.id)).status == "pending"
        assert not sandbox_dirs(small.data_dir)

        # Within the limit the same routes work.
        written = await client.beta.agents.environments.files.create(
            env.id, type="inline", data=b64(b"x" * 1024), path="/workspace/ok.bin"
        )
        assert written.size_bytes == 1024
    finally:
        await stop()  # type: ignore[misc]


async def test_idempotency_key_replays_environment_creation(stack: Stack) -> None:
    client = stack.aclient()
    config: dict[str, Any] = {"type": "openai_hosted", "files": [_inline("/workspace/a.txt")]}

    first = await client.beta.agents.environments.create(environment=config, idempotency_key="create-env-1")  # type: ignore[arg-type]
    again = await client.beta.agents.environments.create(environment=config, idempotency_key="create-env-1")  # type: ignore[arg-type]
    assert again.id == first.id
    assert [e.id async for e in client.beta.agents.environments.list()] == [first.id]

    async with stack.http() as http:
        replay = await http.post("/agents/environments", json={"environment": config}, headers={"Idempotency-Key": "create-env-1"})
        assert replay.status_code == 201
        assert replay.json()["id"] == first.id
        changed = await http.post(
            "/agents/environments",
            json={"environment": {**config, "files": []}},
            headers={"Idempotency-Key": "create-env-1"},
        )
        assert_error(changed, 409, "idempotency_key_reused")
        assert changed.headers.get("x-should-retry") == "false"
    reused = await api_error(client.beta.agents.environments.create(environment=HOSTED, idempotency_key="create-env-1"))  # type: ignore[arg-type]
    assert (reused.status_code, reused.code) == (409, "idempotency_key_reused")
    assert [e.id async for e in client.beta.agents.environments.list()] == [first.id]

    other = await client.beta.agents.environments.create(environment=config, idempotency_key="create-env-2")  # type: ignore[arg-type]
    assert other.id != first.id

    # Keys are scoped to the organization.
    stranger = stack.aclient(await stack.new_key("org-b"))
    theirs = await stranger.beta.agents.environments.create(environment=config, idempotency_key="create-env-1")  # type: ignore[arg-type]
    assert theirs.id not in (first.id, other.id)

    # A replay never resurrects a deleted environment's response as a new one.
    await delete_environment(client, other.id)
    replayed = await client.beta.agents.environments.create(environment=config, idempotency_key="create-env-2")  # type: ignore[arg-type]
    assert replayed.id == other.id
    assert [e.id async for e in client.beta.agents.environments.list()] == [first.id]


@pytest.mark.parametrize("key", ["", "k" * 256])
async def test_malformed_idempotency_keys_are_rejected(stack: Stack, key: str) -> None:
    async with stack.http() as http:
        response = await http.post("/agents/environments", json={"environment": HOSTED}, headers={"Idempotency-Key": key})
        assert_error(response, 400, "validation_error", param="Idempotency-Key")
        assert await everything(http) == {"/agents/environments": [], "/agents/sessions": [], "/agents": [], "/files": []}
