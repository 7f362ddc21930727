"""Sessions sharing one environment: initialization runs once for all of
them, a failed setup is reported on every attached session and never rerun,
and each session gets its own output directory and artifacts (seeds 000-002)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
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
    next_turn_end,
    run_script,
    sandbox_dirs,
    send_script,
    setup_commands,
    workspace_file,
)
from waiting import wait_until

SESSIONS = 50


async def test_fifty_sessions_initialize_their_environment_once(stack: Stack) -> None:
    client = stack.aclient()
    env = await create_environment(client, setup_commands=setup_commands("echo setup >> /workspace/setup.log"))
    sessions = [await attach_session(client, env.id) for _ in range(SESSIONS)]
    assert {environment_of(s) for s in sessions} == {env.id}
    assert (await client.beta.agents.environments.retrieve(env.id)).session_count == SESSIONS  # type: ignore[attr-defined]

    limits = httpx.Limits(max_connections=SESSIONS, max_keepalive_connections=SESSIONS)
    async with httpx.AsyncClient(
        base_url=stack.base_url,
        headers={"Authorization": f"Bearer {stack.key}", "OpenAI-Beta": "agents=v1"},
        timeout=60,
        limits=limits,
    ) as http:

        async def first_operation(i: int) -> httpx.Response:
            if i % 2:
                return await http.get(f"/agents/environments/{env.id}/files")
            body = {"type": "inline", "path": f"/workspace/by/{sessions[i].id}.txt", "data": b64(sessions[i].id)}
            return await http.post(f"/agents/environments/{env.id}/files", json=body)

        responses = await asyncio.gather(*(first_operation(i) for i in range(SESSIONS)))

    assert [r.status_code for r in responses] == [200] * SESSIONS, [r.text for r in responses if r.status_code != 200]
    assert workspace_file(stack.data_dir, env.id, "/workspace/setup.log").read_text() == "setup\n"
    assert (await client.beta.agents.environments.retrieve(env.id)).status == "ready"

    files = [f.path async for f in client.beta.agents.environments.files.list(env.id, path="/workspace/by")]
    assert sorted(files) == sorted(f"/workspace/by/{s.id}.txt" for s in sessions[::2])

    # A session attached after setup, and its tool calls, do not run setup again.
    late = await attach_session(client, env.id)
    turn = await run_script(client, late.id, "$ wc -l < /workspace/setup.log > /workspace/count.txt")
    assert turn.status == "completed"
    assert workspace_file(stack.data_dir, env.id, "/workspace/count.txt").read_text().strip() == "1"
    assert workspace_file(stack.data_dir, env.id, "/workspace/setup.log").read_text() == "setup\n"


async def test_failed_setup_is_reported_on_every_session_and_never_rerun(stack: Stack) -> None:
    client = stack.aclient()
    env = await create_environment(
        client, setup_commands=setup_commands("echo attempt >> /workspace/setup.log", "exit 3", "echo never > /workspace/never")
    )
    first = await attach_session(client, env.id)
    second = await attach_session(client, env.id)

    failed = await api_error(client.beta.agents.environments.files.list(env.id))
    assert (failed.status_code, failed.code) == (409, "environment_failed")

    info = await client.beta.agents.environments.retrieve(env.id)
    assert info.status == "failed"
    assert info.error["code"] == "setup_command_failed"  # type: ignore[attr-defined]
    assert info.error["message"]  # type: ignore[attr-defined]
    assert "exit 3" not in info.error["message"]  # type: ignore[attr-defined]  # setup command bodies stay confidential
    assert info.id == env.id

    for session in (first, second):
        seen = await client.beta.agents.sessions.retrieve(session.id)
        assert seen.status == "failed"
        assert seen.error
        assert seen.environment.type == "openai_hosted"
        assert (seen.environment.id, seen.environment.status) == (env.id, "failed")  # type: ignore[union-attr, attr-defined]

    async with stack.http() as http:
        write = await http.post(
            f"/agents/environments/{env.id}/files", json={"type": "inline", "path": "/workspace/x.txt", "data": b64("x")}
        )
        assert_error(write, 409, "environment_failed")
        assert_error(await http.get(f"/agents/environments/{env.id}/files"), 409, "environment_failed")

    # A turn that needs the environment fails instead of running setup again.
    turn = await run_script(client, second.id, "$ echo hi > /workspace/hi.txt")
    assert turn.status == "failed"

    assert workspace_file(stack.data_dir, env.id, "/workspace/setup.log").read_text() == "attempt\n"
    assert not workspace_file(stack.data_dir, env.id, "/workspace/never").exists()
    assert not workspace_file(stack.data_dir, env.id, "/workspace/hi.txt").exists()
    assert (await client.beta.agents.environments.retrieve(env.id)).status == "failed"

    # Recovery is explicit: detach the sessions, then delete the failed environment.
    sandbox = sandbox_dirs(stack.data_dir)[env.id]
    in_use = await api_error(delete_environment(client, env.id))
    assert (in_use.status_code, in_use.code) == (409, "environment_in_use")
    for session in (first, second):
        await client.beta.agents.sessions.delete(session.id)
    assert (await delete_environment(client, env.id))["deleted"] is True
    assert not sandbox.exists()


async def test_session_attached_after_setup_failed_is_created_reporting_the_failure(stack: Stack) -> None:
    client = stack.aclient()
    env = await create_environment(client, setup_commands=setup_commands("exit 1"))
    await api_error(client.beta.agents.environments.files.list(env.id))

    late = await attach_session(client, env.id)

    assert late.environment.status == "failed"  # type: ignore[union-attr]
    assert (late.status, bool(late.error)) == ("failed", True)


async def test_cancelling_the_turn_that_started_setup_leaves_setup_running_for_peers(stack: Stack) -> None:
    client = stack.aclient()
    env = await create_environment(
        client,
        setup_commands=setup_commands(
            "echo setup >> /workspace/setup.log; "
            "i=0; while [ ! -f /workspace/release ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done; "
            "test -f /workspace/release"
        ),
    )
    starter = await attach_session(client, env.id)
    peer = await attach_session(client, env.id)

    known = await send_script(client, starter.id, "$ echo starter > /workspace/starter.txt")

    async def setup_running() -> bool:
        return env.id in sandbox_dirs(stack.data_dir) and workspace_file(
            stack.data_dir, env.id, "/workspace/setup.log"
        ).exists()

    await wait_until(setup_running, timeout=15, what="the starter's tool call to start setup")
    await client.beta.agents.sessions.events.create(starter.id, events=[{"type": "agent.session.input.cancel"}])
    cancelled = await next_turn_end(client, starter.id, known)
    assert cancelled.status == "cancelled"

    # Setup still runs: the peer's first operation joins it and succeeds once released.
    peer_operation = asyncio.create_task(
        client.beta.agents.environments.files.create(env.id, type="inline", data=b64("peer"), path="/workspace/peer.txt")
    )
    assert (await client.beta.agents.environments.retrieve(env.id)).status == "pending"
    workspace_file(stack.data_dir, env.id, "/workspace/release").touch()
    assert (await asyncio.wait_for(peer_operation, 30)).path == "/workspace/peer.txt"
    assert (await client.beta.agents.environments.retrieve(env.id)).status == "ready"
    assert not workspace_file(stack.data_dir, env.id, "/workspace/starter.txt").exists()

    # The cancelled session can submit another turn against the same environment.
    again = await run_script(client, starter.id, "$ echo starter > /workspace/starter.txt")
    assert again.status == "completed"
    assert workspace_file(stack.data_dir, env.id, "/workspace/starter.txt").read_text() == "starter\n"
    assert workspace_file(stack.data_dir, env.id, "/workspace/setup.log").read_text() == "setup\n"
    assert (await client.beta.agents.sessions.retrieve(peer.id)).status == "idle"


async def test_each_session_writes_to_its_own_output_directory(stack: Stack) -> None:
    client = stack.aclient()
    owner = await inline_session(client)
    environment_id = environment_of(owner)
    helper = await attach_session(client, environment_id)

    dump = (
        "$ printf '%s\\n' \"$REBYTE_OUTPUT_DIR\" \"$REBYTE_SESSION_ID\" \"$BERTH_OUTPUT_DIR\" \"$BERTH_SESSION_ID\""
        " > /workspace/{name}.txt"
    )
    owner_turn = await run_script(client, owner.id, dump.format(name="owner"))
    helper_turn = await run_script(client, helper.id, dump.format(name="helper"))
    assert (owner_turn.status, helper_turn.status) == ("completed", "completed")

    owner_dir = "/workspace/outputs"
    helper_dir = f"/workspace/outputs/sessions/{helper.id}"
    assert workspace_file(stack.data_dir, environment_id, "/workspace/owner.txt").read_text().split() == [
        owner_dir,
        owner.id,
        owner_dir,
        owner.id,
    ]
    assert workspace_file(stack.data_dir, environment_id, "/workspace/helper.txt").read_text().split() == [
        helper_dir,
        helper.id,
        helper_dir,
        helper.id,
    ]


async def test_sessions_on_a_standalone_environment_all_use_session_subdirectories(stack: Stack) -> None:
    client = stack.aclient()
    env = await create_environment(client)
    first = await attach_session(client, env.id)
    second = await attach_session(client, env.id)

    for session in (first, second):
        turn = await run_script(client, session.id, f"$ echo $REBYTE_OUTPUT_DIR > /workspace/{session.id}.txt")
        assert turn.status == "completed"
        written = workspace_file(stack.data_dir, env.id, f"/workspace/{session.id}.txt").read_text().strip()
        assert written == f"/workspace/outputs/sessions/{session.id}"


async def test_each_session_publishes_only_its_own_outputs_as_artifacts(stack: Stack) -> None:
    client = stack.aclient()
    owner = await inline_session(client)
    environment_id = environment_of(owner)
    helper = await attach_session(client, environment_id)

    helper_turn = await run_script(client, helper.id, '$ echo helper > "$REBYTE_OUTPUT_DIR/report.txt"')
    owner_turn = await run_script(client, owner.id, '$ echo owner > "$REBYTE_OUTPUT_DIR/report.txt"')
    assert (helper_turn.status, owner_turn.status) == ("completed", "completed")

    owner_artifacts = [a async for a in client.beta.agents.sessions.artifacts.list(owner.id)]
    helper_artifacts = [a async for a in client.beta.agents.sessions.artifacts.list(helper.id)]
    # Once sharing began, the owner's collector skips outputs/sessions/.
    assert [(a.turn_id, a.session_id, a.environment_id) for a in owner_artifacts] == [
        (owner_turn.id, owner.id, environment_id)
    ]
    assert [(a.turn_id, a.session_id, a.environment_id) for a in helper_artifacts] == [
        (helper_turn.id, helper.id, environment_id)
    ]
    owner_content = await client.beta.agents.sessions.artifacts.content(owner_artifacts[0].id, session_id=owner.id)
    helper_content = await client.beta.agents.sessions.artifacts.content(helper_artifacts[0].id, session_id=helper.id)
    assert (owner_content.read(), helper_content.read()) == (b"owner\n", b"helper\n")

    # Shared files do not grant access through another session's artifact endpoint.
    foreign = await api_error(client.beta.agents.sessions.artifacts.retrieve(helper_artifacts[0].id, session_id=owner.id))
    assert (foreign.status_code, foreign.code) == (404, "not_found")


async def test_artifact_path_is_the_absolute_path_in_the_environment(stack: Stack) -> None:
    client = stack.aclient()
    owner = await inline_session(client)
    helper = await attach_session(client, environment_of(owner))
    await run_script(client, helper.id, '$ echo helper > "$REBYTE_OUTPUT_DIR/report.txt"')
    await run_script(client, owner.id, '$ echo owner > "$REBYTE_OUTPUT_DIR/report.txt"')

    owner_paths = [a.path async for a in client.beta.agents.sessions.artifacts.list(owner.id)]
    helper_paths = [a.path async for a in client.beta.agents.sessions.artifacts.list(helper.id)]
    assert owner_paths == ["/workspace/outputs/report.txt"]
    assert helper_paths == [f"/workspace/outputs/sessions/{helper.id}/report.txt"]


async def test_attached_sessions_share_files_but_not_history(stack: Stack) -> None:
    client = stack.aclient()
    env = await create_environment(client, files=[{"type": "inline", "path": "/workspace/shared.txt", "data": b64("v1")}])
    first = await attach_session(client, env.id)
    second = await attach_session(client, env.id)

    turn = await run_script(client, first.id, "$ echo from-first > /workspace/first.txt\nnoted")
    assert turn.status == "completed"
    listed = {f.path async for f in client.beta.agents.environments.files.list(env.id)}
    assert listed == {"/workspace/shared.txt", "/workspace/first.txt"}
    turn = await run_script(client, second.id, "$ cat /workspace/first.txt > /workspace/second.txt")
    assert turn.status == "completed"
    assert workspace_file(stack.data_dir, env.id, "/workspace/second.txt").read_text() == "from-first\n"

    first_turns = [t.id async for t in client.beta.agents.sessions.turns.list(first.id)]
    second_turns = [t.id async for t in client.beta.agents.sessions.turns.list(second.id)]
    assert len(first_turns) == len(second_turns) == 1
    assert not set(first_turns) & set(second_turns)
    second_items = [i async for i in client.beta.agents.sessions.items.list(second.id)]
    assert all(i.turn_id == second_turns[0] for i in second_items)


async def test_inline_environments_stay_separate_for_sessions_of_the_same_agent(stack: Stack) -> None:
    client = stack.aclient()
    agent = await client.beta.agents.create(model="scripted")
    first = await client.beta.agents.sessions.create(agent_id=agent.id, environment={"type": "openai_hosted"})
    second = await client.beta.agents.sessions.create(agent_id=agent.id, environment={"type": "openai_hosted"})
    assert environment_of(first) != environment_of(second)

    await client.beta.agents.environments.files.create(
        environment_of(first), type="inline", data=b64("mine"), path="/workspace/mine.txt"
    )
    assert [f async for f in client.beta.agents.environments.files.list(environment_of(second))] == []
    for session in (first, second):
        info = await client.beta.agents.environments.retrieve(environment_of(session))
        assert (info.lifetime, info.session_count) == ("private", 1)  # type: ignore[attr-defined]
