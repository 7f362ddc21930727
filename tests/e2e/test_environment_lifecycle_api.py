"""Environment lifecycle through the gateway with the official SDK: standalone
creation, references and shared lifetime, lazy provisioning, and the rules of
deletion (seeds 000 and 001)."""

from __future__ import annotations

import asyncio

from e2e_stack import Stack
from e2e_support import (
    api_error,
    assert_error,
    attach_session,
    b64,
    create_environment,
    delete_environment,
    environment_of,
    inline_session,
    run_script,
    sandbox_dirs,
    sandboxes_root,
    setup_commands,
    workspace_file,
)
from waiting import wait_until


async def test_http_example_shares_one_environment_between_two_sessions_until_it_is_deleted(stack: Stack) -> None:
    client = stack.aclient()
    async with stack.http() as http:
        created = await http.post("/agents/environments", json={"environment": {"type": "openai_hosted"}})
        assert created.status_code == 201, created.text
        env = created.json()
        assert env["object"] == "agent.environment"
        assert env["type"] == "openai_hosted"
        assert env["status"] == "pending"
        assert env["lifetime"] == "private"
        assert env["session_count"] == 0
        environment_id = env["id"]

        session_ids = []
        for _ in range(2):
            response = await http.post(
                "/agents/sessions",
                json={
                    "agent": {"model": "gpt-6-luna"},
                    "environment": {"type": "reference", "environment_id": environment_id},
                },
            )
            assert response.status_code == 200, response.text
            session_ids.append(response.json()["id"])

    for session_id in session_ids:
        session = await client.beta.agents.sessions.retrieve(session_id)
        assert session.environment.type == "openai_hosted"
        assert session.environment.id == environment_id

    shared = await client.beta.agents.environments.retrieve(environment_id)
    assert shared.status == "pending"
    assert shared.lifetime == "shared"  # type: ignore[attr-defined]
    assert shared.session_count == 2  # type: ignore[attr-defined]

    await client.beta.agents.sessions.delete(session_ids[0])
    one_left = await client.beta.agents.environments.retrieve(environment_id)
    assert (one_left.lifetime, one_left.session_count) == ("shared", 1)  # type: ignore[attr-defined]

    await client.beta.agents.sessions.delete(session_ids[1])
    survivor = await client.beta.agents.environments.retrieve(environment_id)
    assert survivor.id == environment_id
    assert (survivor.lifetime, survivor.session_count) == ("shared", 0)  # type: ignore[attr-defined]

    deleted = await delete_environment(client, environment_id)
    assert deleted == {"id": environment_id, "object": "agent.environment.deleted", "deleted": True}

    missing = await api_error(client.beta.agents.environments.retrieve(environment_id))
    assert (missing.status_code, missing.code) == (404, "not_found")


async def test_openai_hosted_with_an_environment_id_attaches_like_a_reference(stack: Stack) -> None:
    client = stack.aclient()
    env = await create_environment(client)

    by_hosted = await attach_session(client, env.id, form="openai_hosted")
    by_reference = await attach_session(client, env.id)

    assert environment_of(by_hosted) == environment_of(by_reference) == env.id
    retrieved = await client.beta.agents.environments.retrieve(env.id)
    assert (retrieved.lifetime, retrieved.session_count) == ("shared", 2)  # type: ignore[attr-defined]


async def test_a_reference_makes_an_inline_environment_shared_for_good(stack: Stack) -> None:
    client = stack.aclient()
    owner = await inline_session(client)
    environment_id = environment_of(owner)
    private = await client.beta.agents.environments.retrieve(environment_id)
    assert (private.lifetime, private.session_count) == ("private", 1)  # type: ignore[attr-defined]

    helper = await attach_session(client, environment_id)
    assert environment_of(helper) == environment_id
    await client.beta.agents.sessions.delete(helper.id)

    # One session remains, but the environment never becomes private again.
    still_shared = await client.beta.agents.environments.retrieve(environment_id)
    assert (still_shared.lifetime, still_shared.session_count) == ("shared", 1)  # type: ignore[attr-defined]


async def test_a_session_cannot_switch_environments(stack: Stack) -> None:
    client = stack.aclient()
    env = await create_environment(client)
    other = await create_environment(client)
    session = await attach_session(client, env.id)

    async with stack.http() as http:
        switch = await http.post(
            f"/agents/sessions/{session.id}",
            json={"environment": {"type": "reference", "environment_id": other.id}},
        )
        assert_error(switch, 400, "validation_error", param="environment")

    assert environment_of(await client.beta.agents.sessions.retrieve(session.id)) == env.id
    assert (await client.beta.agents.environments.retrieve(other.id)).session_count == 0  # type: ignore[attr-defined]


async def test_creating_environments_sessions_and_agents_allocates_no_sandbox(stack: Stack) -> None:
    client = stack.aclient()
    standalone = await create_environment(client, files=[{"type": "inline", "path": "/workspace/in.txt", "data": b64("x")}])
    inline = await inline_session(client)
    agent = await client.beta.agents.create(model="scripted", name="worker")
    from_agent = await client.beta.agents.sessions.create(agent_id=agent.id, environment={"type": "openai_hosted"})
    attached = await attach_session(client, standalone.id)

    # A chat message that uses no environment tool allocates nothing either.
    turn = await run_script(client, from_agent.id, "hello there")
    assert turn.status == "completed"

    assert not sandbox_dirs(stack.data_dir)
    assert not any(sandboxes_root(stack.data_dir).glob("*"))
    for environment_id in (standalone.id, environment_of(inline), environment_of(from_agent), environment_of(attached)):
        assert (await client.beta.agents.environments.retrieve(environment_id)).status == "pending"

    # The first file operation initializes exactly the environment it names.
    listed = [f async for f in client.beta.agents.environments.files.list(standalone.id)]
    assert [f.path for f in listed] == ["/workspace/in.txt"]
    assert (await client.beta.agents.environments.retrieve(standalone.id)).status == "ready"
    assert set(sandbox_dirs(stack.data_dir)) == {standalone.id}

    written = await client.beta.agents.environments.files.create(
        environment_of(inline), type="inline", data=b64("y"), path="/workspace/y.txt"
    )
    assert (written.path, written.size_bytes) == ("/workspace/y.txt", 1)
    assert (await client.beta.agents.environments.retrieve(environment_of(inline))).status == "ready"
    assert set(sandbox_dirs(stack.data_dir)) == {standalone.id, environment_of(inline)}
    assert (await client.beta.agents.environments.retrieve(environment_of(from_agent))).status == "pending"


async def test_environment_with_an_attached_session_is_in_use(stack: Stack) -> None:
    client = stack.aclient()
    env = await create_environment(client)
    session = await attach_session(client, env.id)

    async with stack.http() as http:
        assert_error(await http.delete(f"/agents/environments/{env.id}"), 409, "environment_in_use")
    in_use = await api_error(delete_environment(client, env.id))
    assert (in_use.status_code, in_use.code) == (409, "environment_in_use")
    assert (await client.beta.agents.environments.retrieve(env.id)).session_count == 1  # type: ignore[attr-defined]

    await client.beta.agents.sessions.delete(session.id)
    assert (await delete_environment(client, env.id))["deleted"] is True


async def test_environment_cannot_be_deleted_or_referenced_while_its_setup_runs(stack: Stack) -> None:
    client = stack.aclient()
    # Setup announces itself, then holds until the test releases it.
    env = await create_environment(
        client,
        setup_commands=setup_commands(
            "touch /workspace/setup-started; "
            "i=0; while [ ! -f /workspace/release ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done; "
            "test -f /workspace/release"
        ),
    )
    early = await attach_session(client, env.id)  # pending accepts references
    first_operation = asyncio.create_task(
        client.beta.agents.environments.files.create(env.id, type="inline", data=b64("a"), path="/workspace/a.txt")
    )
    try:

        async def setup_started() -> bool:
            return env.id in sandbox_dirs(stack.data_dir) and workspace_file(
                stack.data_dir, env.id, "/workspace/setup-started"
            ).exists()

        await wait_until(setup_started, timeout=15, what="setup to start")
        # Initializing is still "pending" on the wire (the SDK has no such state).
        assert (await client.beta.agents.environments.retrieve(env.id)).status == "pending"

        async with stack.http() as http:
            await client.beta.agents.sessions.delete(early.id)
            assert_error(await http.delete(f"/agents/environments/{env.id}"), 409, "environment_initializing")
            late = await http.post(
                "/agents/sessions",
                json={"agent": {"model": "scripted"}, "environment": {"type": "reference", "environment_id": env.id}},
            )
            assert_error(late, 409, "environment_initializing")
        sessions = [s async for s in client.beta.agents.sessions.list()]
        assert sessions == []  # the refused reference created no session
    finally:
        if env.id in sandbox_dirs(stack.data_dir):
            workspace_file(stack.data_dir, env.id, "/workspace/release").touch()
        written = await asyncio.wait_for(first_operation, 30)

    assert written.path == "/workspace/a.txt"
    assert (await client.beta.agents.environments.retrieve(env.id)).status == "ready"
    assert (await delete_environment(client, env.id))["deleted"] is True
    assert env.id not in sandbox_dirs(stack.data_dir)


async def test_private_inline_environment_is_deleted_with_its_session(stack: Stack) -> None:
    client = stack.aclient()
    session = await inline_session(client)
    environment_id = environment_of(session)
    await client.beta.agents.environments.files.create(
        environment_id, type="inline", data=b64("private"), path="/workspace/p.txt"
    )
    sandbox = sandbox_dirs(stack.data_dir)[environment_id]
    assert sandbox.is_dir()

    deleted = await client.beta.agents.sessions.delete(session.id)
    assert (deleted.id, deleted.deleted) == (session.id, True)

    gone = await api_error(client.beta.agents.environments.retrieve(environment_id))
    assert (gone.status_code, gone.code) == (404, "not_found")
    assert not sandbox.exists()
    assert environment_id not in sandbox_dirs(stack.data_dir)


async def test_never_initialized_private_environment_is_deleted_with_its_session(stack: Stack) -> None:
    client = stack.aclient()
    session = await inline_session(client)
    environment_id = environment_of(session)

    await client.beta.agents.sessions.delete(session.id)

    gone = await api_error(client.beta.agents.environments.retrieve(environment_id))
    assert (gone.status_code, gone.code) == (404, "not_found")
    assert not sandbox_dirs(stack.data_dir)


async def test_shared_environment_keeps_its_files_after_its_last_session_is_deleted(stack: Stack) -> None:
    client = stack.aclient()
    owner = await inline_session(client)
    environment_id = environment_of(owner)
    helper = await attach_session(client, environment_id)
    await client.beta.agents.environments.files.create(
        environment_id, type="inline", data=b64("kept"), path="/workspace/kept.txt"
    )

    await client.beta.agents.sessions.delete(owner.id)
    await client.beta.agents.sessions.delete(helper.id)

    survivor = await client.beta.agents.environments.retrieve(environment_id)
    assert (survivor.status, survivor.lifetime, survivor.session_count) == ("ready", "shared", 0)  # type: ignore[attr-defined]
    files = [f async for f in client.beta.agents.environments.files.list(environment_id)]
    assert [(f.path, f.size_bytes) for f in files] == [("/workspace/kept.txt", 4)]
    sandbox = sandbox_dirs(stack.data_dir)[environment_id]

    await delete_environment(client, environment_id)
    assert not sandbox.exists()


async def test_deleted_environment_is_not_found_on_every_route(stack: Stack) -> None:
    client = stack.aclient()
    env = await create_environment(client)
    await client.beta.agents.environments.files.list(env.id)  # initialized, so a sandbox is destroyed too
    await delete_environment(client, env.id)
    assert not sandbox_dirs(stack.data_dir)

    async with stack.http() as http:
        assert_error(await http.get(f"/agents/environments/{env.id}"), 404, "not_found")
        assert_error(await http.delete(f"/agents/environments/{env.id}"), 404, "not_found")
        assert_error(await http.get(f"/agents/environments/{env.id}/files"), 404, "not_found")
        assert_error(
            await http.post(
                f"/agents/environments/{env.id}/files",
                json={"type": "inline", "path": "/workspace/a.txt", "data": b64("a")},
            ),
            404,
            "not_found",
        )
        reference = await http.post(
            "/agents/sessions",
            json={"agent": {"model": "scripted"}, "environment": {"type": "reference", "environment_id": env.id}},
        )
        assert_error(reference, 404, "not_found")
    assert [s async for s in client.beta.agents.sessions.list()] == []
    assert not sandbox_dirs(stack.data_dir)


async def test_deleting_a_saved_agent_keeps_its_sessions_and_environments(stack: Stack) -> None:
    client = stack.aclient()
    agent = await client.beta.agents.create(model="scripted")
    session = await client.beta.agents.sessions.create(agent_id=agent.id, environment={"type": "openai_hosted"})
    environment_id = environment_of(session)

    deleted = await client.beta.agents.delete(agent.id)
    assert (deleted.id, deleted.deleted) == (agent.id, True)

    assert (await client.beta.agents.sessions.retrieve(session.id)).id == session.id
    assert (await client.beta.agents.environments.retrieve(environment_id)).id == environment_id
    turn = await run_script(client, session.id, "still here")
    assert turn.status == "completed"

