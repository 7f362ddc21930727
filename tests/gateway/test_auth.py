from __future__ import annotations

import httpx

from gateway_support import BETA, Stack
from gateway.keys import create_key, ensure_dev_key, list_keys, revoke_key


async def test_created_key_authenticates_until_revoked_then_fails_at_once(stack: Stack) -> None:
    record, key = await create_key(stack.db, "acme", ["tasks:read"], name="ci")
    async with stack.client(key) as client:
        assert (await client.get("/v1/agents/environments")).status_code == 200
        await revoke_key(stack.db, record.prefix)
        response = await client.get("/v1/agents/environments")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


async def test_keys_are_stored_hashed_and_listed_by_prefix(stack: Stack) -> None:
    record, key = await create_key(stack.db, "beta-org", ["api.agents.read", "api.agents.write"])
    listed = {k.id: k for k in await list_keys(stack.db, "beta-org")}
    assert key.startswith("sk-berth-") and len(key) == len("sk-berth-") + 43
    assert listed[record.id].scopes == ("tasks:read", "tasks:write")
    assert key.startswith(listed[record.id].prefix) and listed[record.id].prefix != key


async def test_revoking_by_key_id_marks_the_record_revoked(stack: Stack) -> None:
    record, _ = await create_key(stack.db, "acme", ["tasks:read"])
    revoked = await revoke_key(stack.db, record.id)
    assert revoked.revoked


async def test_dev_key_is_created_only_for_an_org_without_keys(stack: Stack) -> None:
    first = await ensure_dev_key(stack.db, "dev")
    second = await ensure_dev_key(stack.db, "dev")
    assert first is not None and second is None
    async with stack.client(first) as client:
        assert (await client.post("/v1/agents/environments", json={"environment": {"type": "openai_hosted"}})).status_code == 201


async def test_request_without_key_is_401_missing_api_key(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.base_url, headers=BETA) as client:
        response = await client.get("/v1/agents/sessions")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "missing_api_key"


async def test_unknown_key_is_401_invalid_api_key(stack: Stack) -> None:
    async with stack.client("sk-berth-" + "x" * 43) as client:
        response = await client.get("/v1/agents/sessions")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


async def test_read_only_key_cannot_create_and_service_is_not_called(stack: Stack) -> None:
    _, key = await create_key(stack.db, "acme", ["tasks:read"])
    async with stack.client(key) as client:
        response = await client.post("/v1/agents/environments", json={"environment": {"type": "openai_hosted"}})
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "insufficient_scopes"
    assert stack.environment.count("CreateEnvironment") == 0


async def test_write_only_key_cannot_read(stack: Stack) -> None:
    _, key = await create_key(stack.db, "acme", ["tasks:write"])
    async with stack.client(key) as client:
        response = await client.get("/v1/agents/environments")
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "insufficient_scopes"


async def test_agents_routes_require_the_beta_header(stack: Stack) -> None:
    async with stack.client(beta=False) as client:
        missing = await client.get("/v1/agents/environments")
        wrong = await client.get("/v1/agents/environments", headers={"OpenAI-Beta": "assistants=v2"})
        combined = await client.get("/v1/agents/environments", headers={"OpenAI-Beta": "assistants=v2, agents=v1"})
    assert (missing.status_code, missing.json()["error"]["code"]) == (400, "missing_beta_header")
    assert (wrong.status_code, wrong.json()["error"]["code"]) == (400, "missing_beta_header")
    assert combined.status_code == 200


async def test_files_routes_do_not_require_the_beta_header(stack: Stack) -> None:
    async with stack.client(beta=False) as client:
        response = await client.get("/v1/files")
    assert response.status_code == 200


async def test_the_keys_org_reaches_the_service_as_metadata(stack: Stack) -> None:
    async with stack.client() as client:
        await client.get("/v1/agents/environments")
    assert stack.environment.calls[-1][2] == stack.org_id


async def test_another_orgs_environment_is_not_found(stack: Stack) -> None:
    foreign = stack.environment.add_environment("org_other")
    async with stack.client() as client:
        response = await client.get(f"/v1/agents/environments/{foreign.id}")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"
