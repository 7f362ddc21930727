"""Saved agents, sessions, environments bindings, artifacts and org scoping,
against a fake Environment service."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest
from openai.types.beta.agent import Agent
from openai.types.beta.agent_session import AgentSession
from openai.types.beta.agents.sessions.session_artifact import SessionArtifact
from session_support import Client, FakeEnvironmentService

from berth.environment.v1 import environment_pb2
from berth.session.v1 import session_pb2, session_service_pb2
from gateway import render
from services.core.errors import reason_from_rpc_error

NONE_ENV = {"type": "none"}
HOSTED = {"type": "openai_hosted"}


async def test_saved_agents_render_as_sdk_agents_and_update_by_key(client: Client) -> None:
    created = await client.create_agent(
        {
            "model": "scripted",
            "name": "Weather bot",
            "instructions": "Be brief.",
            "metadata": {"team": "a"},
            "tools": [
                {"type": "function", "name": "get_weather", "description": "Weather", "parameters": {"type": "object"}},
                {"type": "mcp", "server_label": "docs", "transport": {"type": "http", "server_url": "https://mcp.example"}},
            ],
        }
    )
    agent = Agent.model_validate(created)
    assert agent.name == "Weather bot" and agent.tools[0].defer_loading is False  # type: ignore[union-attr]
    assert created["tools"][1]["transport"] == {"type": "http", "server_url": "https://mcp.example", "headers": {}}

    r = await client.update_agent(agent.id, {"name": None, "tools": None})
    updated = render.agent(r.agent)
    assert updated["name"] is None and updated["tools"] == [] and updated["instructions"] == "Be brief."
    assert r.agent.version == 2

    await client.create_agent({"model": "scripted", "name": "second"})
    page = await client.stub.ListAgents(
        session_service_pb2.ListAgentsRequest(page=session_service_pb2.PageRequest(limit=1, order="asc")), metadata=client.md
    )
    assert [a.id for a in page.agents] == [agent.id] and page.has_more

    await client.stub.DeleteAgent(session_service_pb2.DeleteAgentRequest(agent_id=agent.id), metadata=client.md)
    with pytest.raises(grpc.aio.AioRpcError) as gone:
        await client.stub.GetAgent(session_service_pb2.GetAgentRequest(agent_id=agent.id), metadata=client.md)
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND


async def test_agent_configs_break_no_service_invariant(client: Client) -> None:
    for config, param in [
        (session_pb2.AgentConfig(model=""), "model"),
        (
            session_pb2.AgentConfig(
                model="m", tools=[session_pb2.Tool(function=session_pb2.FunctionTool(name="exec_command"))]
            ),
            "tools[0].name",
        ),
        (
            session_pb2.AgentConfig(
                model="m",
                tools=[session_pb2.Tool(function=session_pb2.FunctionTool(name="f")) for _ in range(2)],
            ),
            "tools[1].name",
        ),
        (
            session_pb2.AgentConfig(
                model="m", multi_agent=session_pb2.MultiAgentConfig(enabled=True, max_concurrent_subagents=0)
            ),
            "multi_agent.max_concurrent_subagents",
        ),
        (
            session_pb2.AgentConfig(
                model="m", tools=[session_pb2.Tool(function=session_pb2.FunctionTool(name="create_subagent"))]
            ),
            "tools[0].name",
        ),
        (
            session_pb2.AgentConfig(
                model="m",
                tools=[
                    session_pb2.Tool(
                        mcp=session_pb2.McpTool(
                            server_label="docs",
                            transport=session_pb2.McpTransport(
                                http=session_pb2.McpHttpTransport(server_url="https://mcp.example", authorization="Bearer x")
                            ),
                        )
                    )
                ],
            ),
            "tools[0].transport.authorization",
        ),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await client.stub.CreateAgent(session_service_pb2.CreateAgentRequest(config=config), metadata=client.md)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert reason_from_rpc_error(error.value)[1].get("param") == param


async def test_a_session_snapshots_its_saved_agent_with_overrides(client: Client) -> None:
    saved = await client.create_agent({"model": "scripted", "name": "base", "instructions": "Base."})
    created = await client.create_session({"agent_id": saved["id"], "agent": {"instructions": "Override."}, "environment": NONE_ENV})
    session = created.session
    snapshot = render.session_agent(session.agent)
    assert snapshot["id"] == saved["id"] and snapshot["name"] == "base" and snapshot["instructions"] == "Override."
    AgentSession.model_validate(render.session(session))

    await client.update_agent(saved["id"], {"instructions": "Changed."})
    await client.stub.DeleteAgent(session_service_pb2.DeleteAgentRequest(agent_id=saved["id"]), metadata=client.md)
    kept = await client.get_session(session.id)
    assert kept.agent.config.instructions == "Override."

    listed = await client.stub.ListSessions(session_service_pb2.ListSessionsRequest(agent_id=saved["id"]), metadata=client.md)
    assert [s.id for s in listed.sessions] == [session.id]


async def test_inline_agents_get_a_generated_id_and_credentials_are_never_echoed(client: Client) -> None:
    agent = {
        "model": "scripted",
        "tools": [
            {
                "type": "mcp",
                "server_label": "docs",
                "transport": {"type": "http", "server_url": "https://mcp.example", "authorization": "Bearer secret"},
            }
        ],
    }
    created = await client.create_session({"agent": agent, "environment": NONE_ENV})
    assert "secret" not in str(created.session)
    snapshot = render.session_agent(created.session.agent)
    assert snapshot["id"].startswith("agent_") and snapshot["tools"][0]["transport"] == {"type": "http", "server_url": "https://mcp.example"}
    events = await client.events(created.session.id)
    assert "secret" not in json.dumps(events)


async def test_update_session_replaces_metadata_and_changes_the_model(client: Client) -> None:
    created = await client.create_session({"agent": {"model": "scripted"}, "environment": NONE_ENV, "metadata": {"a": "1", "b": "2"}})
    r = await client.update_session(
        created.session.id,
        {"metadata": {"c": "3"}, "agent": {"model": "scripted-2", "reasoning": {"effort": "high"}, "service_tier": None}},
    )
    assert dict(r.session.metadata) == {"c": "3"}
    snapshot = render.session_agent(r.session.agent)
    assert snapshot["model"] == "scripted-2" and snapshot["reasoning"]["effort"] == "high" and snapshot["service_tier"] == "auto"
    cleared = await client.update_session(created.session.id, {"metadata": None})
    assert dict(cleared.session.metadata) == {}


async def test_sessions_list_newest_first_with_cursors(client: Client) -> None:
    ids = [(await client.create_session({"agent": {"model": "scripted"}, "environment": NONE_ENV})).session.id for _ in range(3)]
    first = await client.stub.ListSessions(
        session_service_pb2.ListSessionsRequest(page=session_service_pb2.PageRequest(limit=2)), metadata=client.md
    )
    assert [s.id for s in first.sessions] == ids[::-1][:2] and first.has_more
    rest = await client.stub.ListSessions(
        session_service_pb2.ListSessionsRequest(page=session_service_pb2.PageRequest(limit=2, after=first.sessions[-1].id)),
        metadata=client.md,
    )
    assert [s.id for s in rest.sessions] == [ids[0]] and not rest.has_more
    before = await client.stub.ListSessions(
        session_service_pb2.ListSessionsRequest(page=session_service_pb2.PageRequest(limit=1, before=ids[0])),
        metadata=client.md,
    )
    assert [s.id for s in before.sessions] == [ids[1]]


async def test_another_orgs_session_is_not_found(client: Client) -> None:
    created = await client.create_session({"agent": {"model": "scripted"}, "environment": NONE_ENV})
    other = client.as_org("org_b")
    for call in (
        other.get_session(created.session.id),
        other.submit(created.session.id, {"type": "agent.session.input.cancel"}),
        other.events(created.session.id),
        other.stub.DeleteSession(session_service_pb2.DeleteSessionRequest(session_id=created.session.id), metadata=other.md),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
    listed = await other.stub.ListSessions(session_service_pb2.ListSessionsRequest(), metadata=other.md)
    assert list(listed.sessions) == []


async def test_inline_hosted_environment_is_created_for_the_new_session_without_compute(client: Client, fake: FakeEnvironmentService) -> None:
    created = await client.create_session(
        {
            "agent": {"model": "scripted"},
            "environment": {
                "type": "openai_hosted",
                "files": [{"type": "inline", "path": "/workspace/in.txt", "data": "aGk="}],
                "packages": {"python": ["requests"]},
                "network": {"access": "restricted", "allowed_domains": ["example.com"]},
                "setup_commands": [{"command": "echo setup"}],
            },
        }
    )
    session = created.session
    env = fake.envs[session.environment_id]
    assert env.env.owner_session_id == session.id and env.bindings == {session.id: "owner"}
    assert env.env.config.files[0].data == b"hi" and list(env.env.config.packages.python) == ["requests"]
    assert fake.setup_calls == 0
    assert session.environment.status == environment_pb2.ENVIRONMENT_STATUS_PENDING
    created_event = (await client.events(session.id))[0][1]
    client.validate(created_event)
    assert created_event["session"]["environment"]["network"]["access"] == "restricted"
    AgentSession.model_validate(render.session(session))


async def test_a_reference_attaches_and_attach_errors_propagate(client: Client, fake: FakeEnvironmentService) -> None:
    owner = (await client.create_session({"agent": {"model": "scripted"}, "environment": HOSTED})).session
    ref = await client.create_session(
        {"agent": {"model": "scripted"}, "environment": {"type": "reference", "environment_id": owner.environment_id}}
    )
    assert ref.session.environment_id == owner.environment_id
    assert fake.envs[owner.environment_id].bindings[ref.session.id] == "reference"

    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await client.create_session({"agent": {"model": "scripted"}, "environment": {"type": "openai_hosted", "environment_id": "env_nope"}})
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND

    fake.envs[owner.environment_id].env.status = environment_pb2.ENVIRONMENT_STATUS_INITIALIZING
    with pytest.raises(grpc.aio.AioRpcError) as running:
        await client.create_session({"agent": {"model": "scripted"}, "environment": {"type": "reference", "environment_id": owner.environment_id}})
    assert running.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert reason_from_rpc_error(running.value)[0] == "INITIALIZATION_RUNNING"
    # A reference combined with inline configuration cannot be expressed in
    # the contract (a oneof); the gateway rejects the body
    # (tests/e2e/test_api_validation.py).


async def test_failed_setup_fails_the_turn_with_sandbox_error_and_the_session_reports_it(client: Client, fake: FakeEnvironmentService) -> None:
    async def broken(env: Any) -> None:
        raise RuntimeError("setup command exited with 3")

    fake.setup = broken
    created = await client.create_session({"agent": {"model": "scripted"}, "environment": HOSTED, "input": "$ echo never"})
    session_id = created.session.id
    end = await client.wait_turn_end(session_id, created.turn_id)
    assert end["type"] == "agent.session.turn.failed"
    assert end["turn"]["error"] == {"code": "sandbox_error", "message": "setup command exited with 3"}
    events = [e for _, e in await client.events(session_id)]
    for event in events:
        client.validate(event)
    kinds = [e["type"] for e in events]
    assert kinds.index("agent.session.environment.pending") < kinds.index("agent.session.environment.failed")
    failed_env = next(e for e in events if e["type"] == "agent.session.environment.failed")
    assert failed_env["environment"]["error"]["message"] == "setup command exited with 3"
    assert kinds[-1] == "agent.session.failed" and events[-1]["session"]["error"] == "setup command exited with 3"

    session = await client.get_session(session_id)
    assert session.status == session_pb2.SESSION_STATUS_FAILED and session.error == "setup command exited with 3"

    # A second session on the same (failed) environment is reported failed too, before any turn.
    ref = await client.create_session(
        {"agent": {"model": "scripted"}, "environment": {"type": "reference", "environment_id": created.session.environment_id}}
    )
    assert ref.session.status == session_pb2.SESSION_STATUS_FAILED and ref.session.error == "setup command exited with 3"
    created_event = (await client.events(ref.session.id))[0][1]
    assert created_event["session"]["status"] == "failed"
    again = await client.get_session(ref.session.id)
    assert again.status == session_pb2.SESSION_STATUS_FAILED and again.error == "setup command exited with 3"
    assert fake.setup_calls == 1


async def test_cancelling_a_turn_waiting_on_setup_stops_only_its_wait(client: Client, fake: FakeEnvironmentService) -> None:
    release = asyncio.Event()

    async def slow(env: Any) -> None:
        await release.wait()

    fake.setup = slow
    created = await client.create_session({"agent": {"model": "scripted"}, "environment": HOSTED, "input": "$ echo hi"})
    session_id = created.session.id
    await client.wait_for(session_id, lambda e: e["type"] == "agent.session.environment.pending")
    await client.submit(session_id, {"type": "agent.session.input.cancel"})
    end = await client.wait_turn_end(session_id, created.turn_id, timeout=2.0)
    assert end["type"] == "agent.session.turn.cancelled"
    env = fake.envs[created.session.environment_id]
    assert env.env.status == environment_pb2.ENVIRONMENT_STATUS_INITIALIZING
    release.set()
    assert env.setup_task is not None
    await asyncio.wait_for(env.setup_task, 2.0)
    assert env.env.status == environment_pb2.ENVIRONMENT_STATUS_READY

    again = await client.say(session_id, "$ echo after")
    end = await client.wait_turn_end(session_id, again)
    assert end["type"] == "agent.session.turn.completed" and fake.setup_calls == 1


async def test_completed_turns_publish_new_or_changed_outputs_as_artifacts(client: Client) -> None:
    created = await client.create_session(
        {"agent": {"model": "scripted"}, "environment": HOSTED, "input": "$ echo one > $REBYTE_OUTPUT_DIR/a.txt; mkdir -p $REBYTE_OUTPUT_DIR/d; echo x > $REBYTE_OUTPUT_DIR/d/b.txt"}
    )
    session_id = created.session.id
    await client.wait_turn_end(session_id, created.turn_id)

    async def artifacts(turn_id: str = "") -> list[Any]:
        r = await client.stub.ListArtifacts(
            session_service_pb2.ListArtifactsRequest(session_id=session_id, turn_id=turn_id, page=session_service_pb2.PageRequest(order="asc")),
            metadata=client.md,
        )
        return list(r.artifacts)

    first = await artifacts()
    assert sorted(a.path for a in first) == ["/workspace/outputs/a.txt", "/workspace/outputs/d/b.txt"]
    assert all(a.turn_id == created.turn_id and a.environment_id == created.session.environment_id for a in first)
    a_txt = next(a for a in first if a.path == "/workspace/outputs/a.txt")
    assert a_txt.size_bytes == 4
    SessionArtifact.model_validate(
        {
            "id": a_txt.id,
            "object": "agent.session.artifact",
            "created_at": a_txt.create_time.seconds,
            "environment_id": a_txt.environment_id,
            "path": a_txt.path,
            "session_id": a_txt.session_id,
            "size_bytes": a_txt.size_bytes,
            "turn_id": a_txt.turn_id,
        }
    )
    content = b"".join(
        [
            m.data
            async for m in client.stub.GetArtifactContent(
                session_service_pb2.GetArtifactContentRequest(session_id=session_id, artifact_id=a_txt.id), metadata=client.md
            )
        ]
    )
    assert content == b"one\n"

    second = await client.say(session_id, "$ echo two > $REBYTE_OUTPUT_DIR/a.txt; touch $REBYTE_OUTPUT_DIR/d/b.txt")
    await client.wait_turn_end(session_id, second)
    republished = await artifacts(second)
    assert [a.path for a in republished] == ["/workspace/outputs/a.txt"]
    assert len(await artifacts()) == 3

    nothing = await client.say(session_id, "no changes")
    await client.wait_turn_end(session_id, nothing)
    assert await artifacts(nothing) == []

    await client.stub.DeleteArtifact(
        session_service_pb2.DeleteArtifactRequest(session_id=session_id, artifact_id=a_txt.id), metadata=client.md
    )
    with pytest.raises(grpc.aio.AioRpcError) as gone:
        await client.stub.GetArtifact(session_service_pb2.GetArtifactRequest(session_id=session_id, artifact_id=a_txt.id), metadata=client.md)
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND

    other = await client.create_session({"agent": {"model": "scripted"}, "environment": NONE_ENV})
    with pytest.raises(grpc.aio.AioRpcError) as scoped:
        await client.stub.GetArtifact(
            session_service_pb2.GetArtifactRequest(session_id=other.session.id, artifact_id=republished[0].id), metadata=client.md
        )
    assert scoped.value.code() == grpc.StatusCode.NOT_FOUND


async def test_deleting_a_session_removes_its_artifacts_and_unreferenced_blobs(client: Client, settings: Any) -> None:
    created = await client.create_session({"agent": {"model": "scripted"}, "environment": HOSTED, "input": "$ echo unique-bytes > $REBYTE_OUTPUT_DIR/x.txt"})
    await client.wait_turn_end(created.session.id, created.turn_id)
    r = await client.stub.ListArtifacts(session_service_pb2.ListArtifactsRequest(session_id=created.session.id), metadata=client.md)
    sha = r.artifacts[0].sha256
    blob = settings.data_dir.resolve() / "artifacts" / sha[:2] / sha
    assert blob.read_bytes() == b"unique-bytes\n"
    await client.stub.DeleteSession(session_service_pb2.DeleteSessionRequest(session_id=created.session.id), metadata=client.md)
    assert not blob.exists()


async def test_two_sessions_on_a_shared_environment_publish_only_their_own_outputs(client: Client) -> None:
    owner = await client.create_session({"agent": {"model": "scripted"}, "environment": HOSTED})
    env_id = owner.session.environment_id
    ref = await client.create_session({"agent": {"model": "scripted"}, "environment": {"type": "reference", "environment_id": env_id}})
    t1 = await client.say(owner.session.id, "$ echo owner > $REBYTE_OUTPUT_DIR/owner.txt")
    await client.wait_turn_end(owner.session.id, t1)
    t2 = await client.say(ref.session.id, "$ echo ref > $REBYTE_OUTPUT_DIR/ref.txt")
    await client.wait_turn_end(ref.session.id, t2)
    t3 = await client.say(owner.session.id, "nothing new")
    await client.wait_turn_end(owner.session.id, t3)

    async def paths(session_id: str) -> list[str]:
        r = await client.stub.ListArtifacts(session_service_pb2.ListArtifactsRequest(session_id=session_id), metadata=client.md)
        return sorted(a.path for a in r.artifacts)

    assert await paths(owner.session.id) == ["/workspace/outputs/owner.txt"]
    assert await paths(ref.session.id) == [f"/workspace/outputs/sessions/{ref.session.id}/ref.txt"]
