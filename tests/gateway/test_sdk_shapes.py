"""The official SDK, with strict response validation, parses what the gateway returns."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest

from gateway_support import Stack

from services.core.wire_json import to_wire


@pytest.fixture
async def client(stack: Stack) -> AsyncIterator[openai.AsyncOpenAI]:
    sdk = openai.AsyncOpenAI(
        base_url=f"{stack.base_url}/v1", api_key=stack.key, max_retries=0, _strict_response_validation=True
    )
    yield sdk
    await sdk.close()


async def test_sdk_parses_a_retrieved_environment_with_its_files(stack: Stack, client: openai.AsyncOpenAI) -> None:
    async with stack.client() as http:
        created = await http.post(
            "/v1/agents/environments",
            json={
                "environment": {
                    "type": "openai_hosted",
                    "files": [{"type": "inline", "path": "/workspace/input.txt", "data": base64.b64encode(b"Shared").decode()}],
                    "setup_commands": [{"command": "echo secret-setup"}],
                    "skills": [{"type": "inline", "name": "s", "description": "d",
                                "source": {"type": "base64", "media_type": "application/zip", "data": "UEsFBg=="}}],
                    "network": {"access": "restricted", "allowed_domains": ["pypi.org"]},
                }
            },
        )
    assert created.status_code == 201
    assert "secret-setup" not in created.text and "UEsFBg" not in created.text
    env = await client.beta.agents.environments.retrieve(created.json()["id"])
    assert env.object == "agent.environment" and env.status == "pending" and env.type == "openai_hosted"
    assert [(f.type, f.path, f.size_bytes) for f in env.files] == [("inline", "/workspace/input.txt", 6)]
    assert env.skills[0].name == "s"
    assert created.json()["lifetime"] == "private" and created.json()["session_count"] == 0
    assert created.json()["network"]["allowed_domains"] == ["pypi.org"]


async def test_sdk_creates_and_parses_a_session_on_a_hosted_environment(stack: Stack, client: openai.AsyncOpenAI) -> None:
    env = stack.environment.add_environment(stack.org_id)
    session = await client.beta.agents.sessions.create(
        environment={"type": "openai_hosted", "environment_id": env.id}, agent={"model": "gpt-test"}, metadata={"k": "v"}
    )
    assert session.object == "agent.session" and session.status == "idle"
    assert session.environment.type == "openai_hosted" and session.environment.id == env.id
    assert session.metadata == {"k": "v"}
    again = await client.beta.agents.sessions.retrieve(session.id)
    assert again.id == session.id


async def test_sdk_parses_a_session_without_environment_and_the_session_list(stack: Stack, client: openai.AsyncOpenAI) -> None:
    stack.session.add_session(stack.org_id)
    stack.session.add_session(stack.org_id, environment=stack.environment.add_environment(stack.org_id))
    page = await client.beta.agents.sessions.list(limit=10)
    assert len(page.data) == 2 and page.has_more is False
    assert {s.environment.type for s in page.data} == {"none", "openai_hosted"}


async def test_sdk_pages_through_environments(stack: Stack, client: openai.AsyncOpenAI) -> None:
    for _ in range(3):
        stack.environment.add_environment(stack.org_id)
    seen = [env.id async for env in client.beta.agents.environments.list(limit=2)]
    assert len(seen) == 3 and len(set(seen)) == 3


async def test_sdk_uploads_a_file_and_stages_it_in_an_environment(
    stack: Stack, client: openai.AsyncOpenAI, tmp_path: Path
) -> None:
    env = stack.environment.add_environment(stack.org_id)
    local = tmp_path / "data.csv"
    local.write_bytes(b"a,b\n1,2\n")
    staged = await client.beta.agents.environments.files.upload(env.id, file=local, path="/workspace/data.csv")
    assert staged.file.path == "/workspace/data.csv" and staged.file.size_bytes == 8
    uploaded = await client.files.retrieve(staged.uploaded_file_id)
    assert (uploaded.filename, uploaded.bytes, uploaded.purpose) == ("data.csv", 8, "user_data")
    content = await client.files.content(staged.uploaded_file_id)
    assert content.content == b"a,b\n1,2\n"
    listed = [f.path async for f in client.beta.agents.environments.files.list(env.id, limit=1)]
    assert listed == ["/workspace/data.csv"]
    deleted = await client.files.delete(staged.uploaded_file_id)
    assert deleted.deleted is True


async def test_sdk_creates_retrieves_and_deletes_a_saved_agent(stack: Stack, client: openai.AsyncOpenAI) -> None:
    agent = await client.beta.agents.create(model="gpt-test", name="Weather bot", instructions="Be brief.")
    assert (agent.object, agent.name, agent.model) == ("agent", "Weather bot", "gpt-test")
    assert stack.session.last("CreateAgent").config.instructions == "Be brief."
    assert (await client.beta.agents.retrieve(agent.id)).id == agent.id
    assert [a.id async for a in client.beta.agents.list()] == [agent.id]


async def test_sdk_submits_input_events_and_lists_turns(stack: Stack, client: openai.AsyncOpenAI) -> None:
    fake = stack.session.add_session(stack.org_id)
    await client.beta.agents.sessions.events.create(
        fake.session.id, events=[{"type": "agent.session.input.message", "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]}]
    )
    submitted = [to_wire(e) for e in stack.session.last("SubmitSessionEvents").events]
    assert submitted[0]["type"] == "agent.session.input.message"
    turns = await client.beta.agents.sessions.turns.list(fake.session.id)
    assert turns.data[0].status == "completed"


async def test_deleting_an_environment_returns_the_deleted_shape(stack: Stack) -> None:
    env = stack.environment.add_environment(stack.org_id)
    async with stack.client() as http:
        response = await http.delete(f"/v1/agents/environments/{env.id}")
    assert response.json() == {"id": env.id, "object": "agent.environment.deleted", "deleted": True}
