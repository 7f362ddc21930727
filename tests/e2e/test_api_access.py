"""Who may do what: another organization's IDs are 404 on every route and
leave the resource untouched; scopes split reads from writes; keys and the
beta header are checked first. One stack, populated once, serves the module."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
from e2e_stack import Stack, destroy_sandboxes, start_stack
from e2e_support import api_error, assert_error, attach_session, b64, create_environment, run_script

pytestmark = pytest.mark.asyncio(loop_scope="module")


@dataclass
class World:
    stack: Stack
    ids: dict[str, str]

    def path(self, template: str) -> str:
        return template.format(**self.ids)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def world(tmp_path_factory: pytest.TempPathFactory, bwrap_available: None) -> AsyncIterator[World]:
    data_dir: Path = tmp_path_factory.mktemp("access") / "berth"
    stack, stop = await start_stack(data_dir)
    try:
        client = stack.aclient()
        env = await create_environment(client, files=[{"type": "inline", "path": "/workspace/owned.txt", "data": b64("mine")}])
        session = await attach_session(client, env.id, metadata={"owner": "a"})
        turn = await run_script(client, session.id, '$ echo result > "$REBYTE_OUTPUT_DIR/result.txt"')
        assert turn.status == "completed"
        artifacts = [a async for a in client.beta.agents.sessions.artifacts.list(session.id)]
        assert len(artifacts) == 1
        stored = await client.files.create(file=("owned.bin", b"owned"), purpose="user_data")
        agent = await client.beta.agents.create(model="scripted", name="owned")
        ids = {
            "env": env.id,
            "sess": session.id,
            "turn": turn.id,
            "art": artifacts[0].id,
            "file": stored.id,
            "agent": agent.id,
        }
        yield World(stack, ids)
    finally:
        await stop()  # type: ignore[misc]
        await destroy_sandboxes(data_dir)


async def owner_view(world: World) -> dict[str, Any]:
    """Everything the owning organization can see of its resources."""
    async with world.stack.http() as http:
        view: dict[str, Any] = {}
        for name, template in (
            ("environment", "/agents/environments/{env}"),
            ("environment_files", "/agents/environments/{env}/files"),
            ("session", "/agents/sessions/{sess}"),
            ("sessions", "/agents/sessions"),
            ("turns", "/agents/sessions/{sess}/turns"),
            ("items", "/agents/sessions/{sess}/items"),
            ("artifacts", "/agents/sessions/{sess}/artifacts"),
            ("file", "/files/{file}"),
            ("agent", "/agents/{agent}"),
            ("agents", "/agents"),
        ):
            response = await http.get(world.path(template))
            assert response.status_code == 200, (name, response.text)
            body = response.json()
            if name == "session":
                body.pop("last_active_at", None)
            view[name] = body
        content = await http.get(world.path("/agents/sessions/{sess}/artifacts/{art}/content"))
        view["artifact_content"] = content.content
        view["file_content"] = (await http.get(world.path("/files/{file}/content"))).content
    return view


def _message(text: str) -> dict[str, Any]:
    return {"events": [{"type": "agent.session.input.message", "input": [{"role": "user", "content": [{"type": "input_text", "text": text}]}]}]}


ID_ROUTES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("GET", "/agents/environments/{env}", None),
    ("DELETE", "/agents/environments/{env}", None),
    ("POST", "/agents/environments/{env}/files", {"type": "inline", "path": "/workspace/intruder.txt", "data": b64("x")}),
    ("GET", "/agents/environments/{env}/files", None),
    ("GET", "/agents/sessions/{sess}", None),
    ("POST", "/agents/sessions/{sess}", {"metadata": {"owner": "b"}}),
    ("DELETE", "/agents/sessions/{sess}", None),
    ("POST", "/agents/sessions/{sess}/events", _message("$ touch /workspace/intruder")),
    ("GET", "/agents/sessions/{sess}/events", None),
    ("GET", "/agents/sessions/{sess}/turns", None),
    ("GET", "/agents/sessions/{sess}/turns/{turn}", None),
    ("GET", "/agents/sessions/{sess}/turns/{turn}/items", None),
    ("GET", "/agents/sessions/{sess}/items", None),
    ("GET", "/agents/sessions/{sess}/artifacts", None),
    ("GET", "/agents/sessions/{sess}/artifacts/{art}", None),
    ("GET", "/agents/sessions/{sess}/artifacts/{art}/content", None),
    ("DELETE", "/agents/sessions/{sess}/artifacts/{art}", None),
    ("GET", "/files/{file}", None),
    ("GET", "/files/{file}/content", None),
    ("DELETE", "/files/{file}", None),
    ("GET", "/agents/{agent}", None),
    ("POST", "/agents/{agent}", {"name": "stolen"}),
    ("DELETE", "/agents/{agent}", None),
    (
        "POST",
        "/agents/sessions",
        {"agent": {"model": "scripted"}, "environment": {"type": "reference", "environment_id": "{env}"}},
    ),
    (
        "POST",
        "/agents/sessions",
        {"agent": {"model": "scripted"}, "environment": {"type": "openai_hosted", "environment_id": "{env}"}},
    ),
    ("POST", "/agents/sessions", {"agent_id": "{agent}", "environment": {"type": "openai_hosted"}}),
]


def _fill(value: Any, world: World) -> Any:
    if isinstance(value, str):
        return world.path(value) if "{" in value else value
    if isinstance(value, dict):
        return {k: _fill(v, world) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, world) for v in value]
    return value


async def _call(http: httpx.AsyncClient, world: World, method: str, template: str, body: dict[str, Any] | None) -> httpx.Response:
    return await http.request(method, world.path(template), json=_fill(body, world) if body is not None else None)


@pytest.mark.parametrize(("method", "template", "body"), ID_ROUTES, ids=[f"{m} {t}" for m, t, _ in ID_ROUTES])
async def test_another_organizations_id_is_not_found_and_left_untouched(
    world: World, method: str, template: str, body: dict[str, Any] | None
) -> None:
    before = await owner_view(world)
    other = await world.stack.new_key("org-b")
    async with world.stack.http(other) as http:
        assert_error(await _call(http, world, method, template, body), 404, "not_found")
        assert (await http.get("/agents/sessions")).json()["data"] == []
    assert await owner_view(world) == before


async def test_another_organizations_lists_show_nothing_of_ours(world: World) -> None:
    other = await world.stack.new_key("org-c")
    async with world.stack.http(other) as http:
        for path in ("/agents/environments", "/agents/sessions", "/agents", "/files"):
            response = await http.get(path)
            assert response.status_code == 200, response.text
            assert response.json()["data"] == [], path


async def test_another_organizations_file_id_in_a_body_is_404_like_in_a_path(world: World) -> None:
    other = await world.stack.new_key("org-b")
    client = world.stack.aclient(other)
    refused = await api_error(
        create_environment(client, files=[{"type": "file_id", "file_id": world.ids["file"], "path": "/workspace/x"}])
    )
    assert (refused.status_code, refused.code) == (404, "not_found")
    env = await create_environment(client)
    staged = await api_error(
        client.beta.agents.environments.files.create(env.id, type="file_id", file_id=world.ids["file"], path="/workspace/x")
    )
    assert (staged.status_code, staged.code) == (404, "not_found")


async def test_a_tool_result_for_another_organizations_turn_is_404_like_in_a_path(world: World) -> None:
    other = await world.stack.new_key("org-b")
    async with world.stack.http(other) as http:
        created = await http.post(
            "/agents/sessions", json={"agent": {"model": "scripted"}, "environment": {"type": "none"}, "input": "hello"}
        )
        assert created.status_code in (200, 201), created.text
        result = {"type": "agent.session.input.tool_result", "turn_id": world.ids["turn"], "call_id": "call_1", "success": True}
        refused = await http.post(f"/agents/sessions/{created.json()['id']}/events", json={"events": [result]})
        assert (refused.status_code, refused.json()["error"]["code"]) == (404, "not_found"), refused.text
        assert refused.json()["error"]["param"] == "events[0].turn_id"


WRITE_ROUTES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("POST", "/agents/environments", {"environment": {"type": "openai_hosted"}}),
    ("DELETE", "/agents/environments/{env}", None),
    ("POST", "/agents/environments/{env}/files", {"type": "inline", "path": "/workspace/w.txt", "data": b64("w")}),
    ("POST", "/agents/sessions", {"agent": {"model": "scripted"}, "environment": {"type": "reference", "environment_id": "{env}"}}),
    ("POST", "/agents/sessions/{sess}", {"metadata": {"owner": "changed"}}),
    ("DELETE", "/agents/sessions/{sess}", None),
    ("POST", "/agents/sessions/{sess}/events", _message("hello")),
    ("DELETE", "/agents/sessions/{sess}/artifacts/{art}", None),
    ("DELETE", "/files/{file}", None),
    ("POST", "/agents", {"model": "scripted"}),
    ("POST", "/agents/{agent}", {"name": "changed"}),
    ("DELETE", "/agents/{agent}", None),
]

READ_ROUTES = [
    "/agents/environments",
    "/agents/environments/{env}",
    "/agents/environments/{env}/files",
    "/agents/sessions",
    "/agents/sessions/{sess}",
    "/agents/sessions/{sess}/turns",
    "/agents/sessions/{sess}/turns/{turn}",
    "/agents/sessions/{sess}/turns/{turn}/items",
    "/agents/sessions/{sess}/items",
    "/agents/sessions/{sess}/artifacts",
    "/agents/sessions/{sess}/artifacts/{art}",
    "/agents/sessions/{sess}/artifacts/{art}/content",
    "/files",
    "/files/{file}",
    "/files/{file}/content",
    "/agents",
    "/agents/{agent}",
]


@pytest.mark.parametrize("read_scope", ["tasks:read", "api.agents.read"])
async def test_read_only_key_reads_everything_and_writes_nothing(world: World, read_scope: str) -> None:
    before = await owner_view(world)
    reader = await world.stack.new_key("org-a", (read_scope,))
    async with world.stack.http(reader) as http:
        for method, template, body in WRITE_ROUTES:
            assert_error(await _call(http, world, method, template, body), 403, "insufficient_scopes")
        upload = await http.post("/files", files={"file": ("x.txt", b"x")}, data={"purpose": "user_data"})
        assert_error(upload, 403, "insufficient_scopes")

        for template in READ_ROUTES:
            response = await http.get(world.path(template))
            assert response.status_code == 200, (template, response.text)
        async with http.stream("GET", world.path("/agents/sessions/{sess}/events")) as events:
            assert events.status_code == 200
            assert events.headers["content-type"].startswith("text/event-stream")
    assert await owner_view(world) == before


async def test_write_only_key_cannot_read(world: World) -> None:
    writer = await world.stack.new_key("org-a", ("api.agents.write",))
    async with world.stack.http(writer) as http:
        for template in ("/agents/sessions/{sess}", "/agents/environments/{env}", "/files"):
            assert_error(await http.get(world.path(template)), 403, "insufficient_scopes")
        created = await http.post("/agents/environments", json={"environment": {"type": "openai_hosted"}})
        assert created.status_code == 201, created.text


async def test_rebyte_scope_names_grant_full_access(world: World) -> None:
    key = await world.stack.new_key("org-a", ("api.agents.read", "api.agents.write"))
    client = world.stack.aclient(key)
    env = await create_environment(client)
    assert (await client.beta.agents.environments.retrieve(env.id)).id == env.id
    assert (await client.beta.agents.sessions.retrieve(world.ids["sess"])).id == world.ids["sess"]


async def test_requests_without_a_valid_key_are_unauthenticated(world: World) -> None:
    async with httpx.AsyncClient(base_url=world.stack.base_url, headers={"OpenAI-Beta": "agents=v1"}) as anonymous:
        assert_error(await anonymous.get(world.path("/agents/sessions/{sess}")), 401, "missing_api_key")
        assert_error(await anonymous.post("/agents/environments", json={}), 401, "missing_api_key")
        assert_error(await anonymous.get("/files"), 401, "missing_api_key")
        wrong_scheme = await anonymous.get("/agents/sessions", headers={"Authorization": f"Basic {world.stack.key}"})
        assert_error(wrong_scheme, 401, "missing_api_key")
    async with world.stack.http("sk-berth-not-a-real-key") as forged:
        assert_error(await forged.get(world.path("/agents/environments/{env}")), 401, "invalid_api_key")
        assert_error(await forged.get("/files"), 401, "invalid_api_key")

    failed = await api_error(world.stack.aclient("sk-berth-nope").beta.agents.environments.retrieve(world.ids["env"]))
    assert isinstance(failed, openai.AuthenticationError)
    assert failed.code == "invalid_api_key"


async def test_agents_routes_require_the_beta_header(world: World) -> None:
    async with world.stack.http(beta=False) as http:
        assert_error(await http.get(world.path("/agents/environments/{env}")), 400, "missing_beta_header")
        assert_error(await http.post("/agents/environments", json={"environment": {"type": "openai_hosted"}}), 400, "missing_beta_header")
        assert_error(await http.get(world.path("/agents/sessions/{sess}/turns")), 400, "missing_beta_header")
        # The SDK sends no beta header to the Files API.
        assert (await http.get(world.path("/files/{file}"))).status_code == 200
        wrong = await http.get("/agents/sessions", headers={"OpenAI-Beta": "assistants=v2"})
        assert_error(wrong, 400, "missing_beta_header")
