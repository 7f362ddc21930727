"""Environment templates through the official SDK with strict response
validation: every ``environments.templates`` method, environments and inline
session environments started from a template with the override rules, the
route never read as an environment ID, cross-org 404 and scope 403."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import pytest_asyncio
from e2e_stack import Stack, running_stack
from e2e_support import api_error, assert_error, attach_session, b64, environment_of, run_script, workspace_file

pytestmark = pytest.mark.asyncio(loop_scope="module")

SECRET_COMMAND = "echo tpl-setup-ran > /workspace/setup.txt"
SECRET_VALUE = "tpl-secret-value-81723"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory, bwrap_available: None) -> AsyncIterator[Stack]:
    async with running_stack(tmp_path_factory.mktemp("templates") / "berth") as s:
        yield s


def strict(stack: Stack, key: str | None = None) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=stack.base_url, api_key=key or stack.key, max_retries=0, timeout=30, _strict_response_validation=True
    )


async def _template(client: openai.AsyncOpenAI, **fields: Any) -> Any:
    return await client.beta.agents.environments.templates.create(**fields)


async def test_templates_crud_through_the_sdk_never_returns_setup_commands_env_or_contents(stack: Stack) -> None:
    client = strict(stack)
    templates = client.beta.agents.environments.templates
    created = await templates.create(
        name="python base",
        files=[{"type": "inline", "path": "/workspace/hello.txt", "data": b64("hello from template")}],
        packages={"python": ["requests"]},
        setup_commands=[{"command": SECRET_COMMAND}],
        network={"access": "restricted", "allowed_domains": ["example.com"]},
        env={"TOKEN": SECRET_VALUE},
        capability_directories=["/workspace/skills"],
    )
    assert created.object == "agent.environment.template"
    assert created.id.startswith("envtpl_")
    assert created.name == "python base"
    assert [(f.type, f.path) for f in created.files] == [("inline", "/workspace/hello.txt")]
    assert created.files[0].size_bytes == len("hello from template")  # type: ignore[union-attr]
    assert created.packages.python == ["requests"]
    assert (created.network.access, created.network.allowed_domains) == ("restricted", ["example.com"])
    assert created.capability_directories == ["/workspace/skills"]

    second = await templates.create()
    assert second.name is None and second.files == [] and second.network.access == "enabled"

    retrieved = await templates.retrieve(created.id)
    assert retrieved.model_dump() == created.model_dump()

    page = await templates.list(limit=1, order="asc")
    assert [t.id for t in page.data] == [created.id] and page.has_more
    listed = [t.id async for t in templates.list(order="desc")]
    assert listed == [second.id, created.id]

    updated = await templates.update(created.id, name=None, network=None, packages={"npm": ["left-pad"]})
    assert updated.name is None
    assert updated.network.access == "enabled"  # null resets to the default policy
    assert (updated.packages.npm, updated.packages.python) == (["left-pad"], [])
    assert [f.path for f in updated.files] == ["/workspace/hello.txt"]  # omitted: kept
    assert updated.updated_at >= created.updated_at

    async with stack.http() as http:
        for path in (f"/agents/environments/templates/{created.id}", "/agents/environments/templates"):
            raw = (await http.get(path)).text
            for secret in (SECRET_COMMAND, SECRET_VALUE, b64("hello from template")):
                assert secret not in raw

    deleted = await templates.delete(second.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (second.id, "agent.environment.template.deleted", True)
    missing = await api_error(templates.retrieve(second.id))
    assert (missing.status_code, missing.code) == (404, "not_found")
    gone = await api_error(templates.delete(second.id))
    assert (gone.status_code, gone.code) == (404, "not_found")


async def test_environment_from_a_template_inherits_omitted_fields_and_takes_the_set_ones(stack: Stack) -> None:
    client = strict(stack)
    template = await _template(
        client,
        files=[{"type": "inline", "path": "/workspace/base.txt", "data": b64("base")}],
        setup_commands=[{"command": SECRET_COMMAND}],
        env={"KEEP": "from-template", "SWAP": "template"},
    )
    env = await client.beta.agents.environments.create(
        environment={
            "type": "openai_hosted",
            "environment_template_id": template.id,
            "env": {"SWAP": "request"},
            "files": None,  # null inherits the template's files
        }
    )
    assert env.status == "pending"
    assert [f.path for f in env.files] == ["/workspace/base.txt"]
    session = await attach_session(client, env.id)
    turn = await run_script(client, session.id, '$ echo "$KEEP $SWAP" > /workspace/vars.txt')
    assert turn.status == "completed"
    assert workspace_file(stack.data_dir, env.id, "/workspace/vars.txt").read_text() == "from-template request\n"
    assert workspace_file(stack.data_dir, env.id, "/workspace/setup.txt").read_text() == "tpl-setup-ran\n"
    assert workspace_file(stack.data_dir, env.id, "/workspace/base.txt").read_text() == "base"

    # Setting a field replaces the template's; later template changes leave the environment alone.
    replaced = await client.beta.agents.environments.create(
        environment={
            "type": "openai_hosted",
            "environment_template_id": template.id,
            "files": [{"type": "inline", "path": "/workspace/own.txt", "data": b64("own")}],
        }
    )
    assert [f.path for f in replaced.files] == ["/workspace/own.txt"]
    await client.beta.agents.environments.templates.delete(template.id)
    assert [f.path for f in (await client.beta.agents.environments.retrieve(env.id)).files] == ["/workspace/base.txt"]


async def test_inline_session_environment_starts_from_a_template(stack: Stack) -> None:
    client = strict(stack)
    template = await _template(
        client, files=[{"type": "inline", "path": "/workspace/seed.txt", "data": b64("seed")}], network={"access": "disabled"}
    )
    session = await client.beta.agents.sessions.create(
        agent={"model": "scripted"}, environment={"type": "openai_hosted", "environment_template_id": template.id}
    )
    assert session.environment.type == "openai_hosted"
    assert [f.path for f in session.environment.files] == ["/workspace/seed.txt"]
    env = await client.beta.agents.environments.retrieve(environment_of(session))
    assert env.network["access"] == "disabled"  # type: ignore[attr-defined]


async def test_network_override_cannot_broaden_the_template_policy(stack: Stack) -> None:
    client = strict(stack)
    closed = await _template(client, network={"access": "disabled"})
    narrow = await _template(client, network={"access": "restricted", "allowed_domains": ["example.com"]})
    async with stack.http() as http:

        async def create(template_id: str, network: dict[str, Any]) -> Any:
            return await http.post(
                "/agents/environments",
                json={"environment": {"type": "openai_hosted", "environment_template_id": template_id, "network": network}},
            )

        assert_error(await create(closed.id, {"access": "enabled"}), 400, "validation_error", param="environment.network.access")
        assert_error(
            await create(narrow.id, {"access": "restricted", "allowed_domains": ["other.org"]}),
            400,
            "validation_error",
            param="environment.network.allowed_domains",
        )
        assert_error(
            await create(narrow.id, {"access": "restricted", "blocked_domains": ["x.example.com"]}),
            400,
            "validation_error",
            param="environment.network.allowed_domains",
        )
        ok = await create(narrow.id, {"access": "restricted", "allowed_domains": ["api.example.com"]})
        assert ok.status_code == 201, ok.text
        assert ok.json()["network"]["allowed_domains"] == ["api.example.com"]
        assert (await create(narrow.id, {"access": "disabled"})).status_code == 201
        before = (await http.get("/agents/environments", params={"limit": 100})).json()["data"]
        assert_error(await create("envtpl_0000000000000000000000000", {"access": "disabled"}), 404, "not_found")
        assert (await http.get("/agents/environments", params={"limit": 100})).json()["data"] == before


async def test_templates_routes_are_never_read_as_environment_ids(stack: Stack) -> None:
    async with stack.http() as http:
        listed = await http.get("/agents/environments/templates")
        assert listed.status_code == 200 and listed.json()["object"] == "list"
        assert_error(await http.get("/agents/environments/templates/env_0000000000000000000000000"), 404, "not_found")
        assert_error(await http.get("/agents/environments/templates/templates"), 404, "not_found")
        assert_error(await http.post("/agents/environments/templates", json={"desktop": {"enabled": True}}), 400, "validation_error", param="desktop")
        assert_error(await http.post("/agents/environments/templates", json={"bogus": 1}), 400, "validation_error")


async def test_another_orgs_template_is_404_everywhere_and_writes_need_the_write_scope(stack: Stack) -> None:
    owner = strict(stack)
    template = await _template(owner, name="mine", files=[{"type": "inline", "path": "/workspace/m.txt", "data": b64("m")}])
    other = await stack.new_key("org-templates-b")
    async with stack.http(other) as http:
        path = f"/agents/environments/templates/{template.id}"
        assert_error(await http.get(path), 404, "not_found")
        assert_error(await http.post(path, json={"name": "stolen"}), 404, "not_found")
        assert_error(await http.delete(path), 404, "not_found")
        assert (await http.get("/agents/environments/templates")).json()["data"] == []
        use = {"type": "openai_hosted", "environment_template_id": template.id}
        assert_error(await http.post("/agents/environments", json={"environment": use}), 404, "not_found")
        assert_error(
            await http.post("/agents/sessions", json={"agent": {"model": "scripted"}, "environment": use}), 404, "not_found"
        )
    reader = await stack.new_key("org-a", scopes=("tasks:read",))
    async with stack.http(reader) as http:
        assert (await http.get(f"/agents/environments/templates/{template.id}")).status_code == 200
        assert_error(await http.post("/agents/environments/templates", json={}), 403, "insufficient_scopes")
        assert_error(
            await http.post(f"/agents/environments/templates/{template.id}", json={"name": "x"}), 403, "insufficient_scopes"
        )
        assert_error(await http.delete(f"/agents/environments/templates/{template.id}"), 403, "insufficient_scopes")
    survivor = await owner.beta.agents.environments.templates.retrieve(template.id)
    assert survivor.name == "mine"
    assert json.dumps(survivor.model_dump()).count("m.txt") == 1


async def test_a_repeated_idempotency_key_replays_the_template_create_without_a_second_template(stack: Stack) -> None:
    client = strict(stack)
    templates = client.beta.agents.environments.templates
    before = [t.id async for t in templates.list()]
    headers = {"Idempotency-Key": "tpl-create-once"}
    first = await templates.create(name="once", extra_headers=headers)
    again = await templates.create(name="once", extra_headers=headers)
    assert again.id == first.id
    assert [t.id async for t in templates.list()] == [first.id, *before]
