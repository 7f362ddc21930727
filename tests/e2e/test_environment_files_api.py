"""Environment files end to end: the Files API, initial files by file ID, the
files routes, the SDK's upload/prepare helpers, token pagination, and an
unreachable Sandbox service."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import openai

from e2e_stack import Stack, start_stack
from e2e_support import (
    api_error,
    assert_error,
    attach_session,
    b64,
    create_environment,
    environment_of,
    next_turn_end,
    run_script,
    sandbox_dirs,
    send_script,
    workspace_file,
)
from turns_support import strict_client
from waiting import wait_until


async def next_environment_event(stack: Stack, session_id: str, event_type: str, *, timeout: float = 30.0) -> Any:
    """The session's first event of ``event_type``, parsed by the SDK's strict models."""
    async with asyncio.timeout(timeout), strict_client(stack) as client:
        stream = await client.beta.agents.sessions.events.stream(session_id, extra_headers={"Last-Event-ID": "0"})
        async with stream:
            async for event in stream:
                if event.type == event_type:
                    return event
    raise AssertionError(f"the event stream ended before {event_type}")


async def test_stored_file_becomes_an_initial_environment_file(stack: Stack) -> None:
    client = stack.aclient()
    stored = await client.files.create(file=("data.csv", b"a,b\n1,2\n", "text/csv"), purpose="user_data")
    assert (stored.object, stored.bytes, stored.filename, stored.purpose) == ("file", 8, "data.csv", "user_data")
    assert (await client.files.retrieve(stored.id)).id == stored.id
    assert (await client.files.content(stored.id)).read() == b"a,b\n1,2\n"

    env = await create_environment(client, files=[{"type": "file_id", "file_id": stored.id, "path": "/workspace/in/data.csv"}])
    assert [(f.type, f.path, f.size_bytes) for f in env.files] == [("file_id", "/workspace/in/data.csv", 8)]
    assert env.files[0].file_id == stored.id  # type: ignore[union-attr]
    assert env.status == "pending"

    listed = [f async for f in client.beta.agents.environments.files.list(env.id)]
    assert [(f.path, f.size_bytes) for f in listed] == [("/workspace/in/data.csv", 8)]
    assert workspace_file(stack.data_dir, env.id, "/workspace/in/data.csv").read_bytes() == b"a,b\n1,2\n"

    # The environment copied the bytes: the caller still owns (and may delete) the upload.
    deleted = await client.files.delete(stored.id)
    assert (deleted.id, deleted.deleted) == (stored.id, True)
    assert [f.path async for f in client.beta.agents.environments.files.list(env.id)] == ["/workspace/in/data.csv"]


async def test_files_are_written_inline_and_by_file_id(stack: Stack) -> None:
    client = stack.aclient()
    env = await create_environment(client)
    stored = await client.files.create(file=("notes.md", b"# notes\n"), purpose="user_data")

    inline = await client.beta.agents.environments.files.create(
        env.id, type="inline", data=b64(b"\x00\x01binary"), path="/workspace/bin/blob"
    )
    by_id = await client.beta.agents.environments.files.create(
        env.id, type="file_id", file_id=stored.id, path="/workspace/docs/notes.md"
    )
    assert (inline.object, inline.environment_id, inline.path, inline.size_bytes) == (
        "agent.environment.file",
        env.id,
        "/workspace/bin/blob",
        8,
    )
    assert (by_id.path, by_id.size_bytes) == ("/workspace/docs/notes.md", 8)

    # Writing a path again replaces the file.
    await client.beta.agents.environments.files.create(env.id, type="inline", data=b64("v2"), path="/workspace/bin/blob")
    listed = {f.path: f.size_bytes async for f in client.beta.agents.environments.files.list(env.id)}
    assert listed == {"/workspace/bin/blob": 2, "/workspace/docs/notes.md": 8}
    assert workspace_file(stack.data_dir, env.id, "/workspace/docs/notes.md").read_bytes() == b"# notes\n"

    unknown = await api_error(
        client.beta.agents.environments.files.create(env.id, type="file_id", file_id="file-nope", path="/workspace/x")
    )
    assert (unknown.status_code, unknown.code, unknown.param) == (404, "not_found", "file_id")


async def test_sdk_upload_helper_stages_a_local_file(stack: Stack, tmp_path: Path) -> None:
    client = stack.aclient()
    env = await create_environment(client)
    local = tmp_path / "report.txt"
    local.write_text("uploaded\n")

    staged = await client.beta.agents.environments.files.upload(env.id, file=local, path="/workspace/up/report.txt")

    assert staged.file.path == "/workspace/up/report.txt"
    assert staged.file.size_bytes == 9
    assert (await client.files.retrieve(staged.uploaded_file_id)).filename == "report.txt"
    assert workspace_file(stack.data_dir, env.id, "/workspace/up/report.txt").read_text() == "uploaded\n"
    await client.files.delete(staged.uploaded_file_id)


async def test_sdk_prepare_helpers_feed_new_environments_and_sessions(stack: Stack, tmp_path: Path) -> None:
    client = stack.aclient()
    single = tmp_path / "single.json"
    single.write_text('{"a": 1}')
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "one.csv").write_text("1\n")
    (tree / "sub" / "two.csv").write_text("22\n")
    (tree / "skip.txt").write_text("not selected\n")

    prepared = await client.beta.agents.environments.files.prepare({"/workspace/cfg/single.json": single})
    directory = await client.beta.agents.environments.files.prepare_directory(
        tree, destination="/workspace/data", include=["*.csv", "sub/*.csv"]
    )
    assert len(prepared.uploaded_file_ids) == 1
    assert sorted(f["path"] for f in directory.files) == ["/workspace/data/one.csv", "/workspace/data/sub/two.csv"]

    env = await create_environment(client, files=[*prepared.files, *directory.files])
    session = await client.beta.agents.sessions.create(
        agent={"model": "scripted"}, environment={"type": "openai_hosted", "files": directory.files}
    )

    expected = {"/workspace/cfg/single.json": 8, "/workspace/data/one.csv": 2, "/workspace/data/sub/two.csv": 3}
    assert {f.path: f.size_bytes async for f in client.beta.agents.environments.files.list(env.id)} == expected
    inline_env = environment_of(session)
    assert {f.path async for f in client.beta.agents.environments.files.list(inline_env)} == {
        "/workspace/data/one.csv",
        "/workspace/data/sub/two.csv",
    }
    assert workspace_file(stack.data_dir, inline_env, "/workspace/data/sub/two.csv").read_text() == "22\n"
    for file_id in [*prepared.uploaded_file_ids, *directory.uploaded_file_ids]:
        await client.files.delete(file_id)


async def test_file_listing_pages_through_every_file_by_path(stack: Stack) -> None:
    client = stack.aclient()
    names = ["a.txt", "b.txt", "c.txt", "d/e.txt", "d/f.txt", "d/g/h.txt", "z.txt"]
    env = await create_environment(
        client, files=[{"type": "inline", "path": f"/workspace/{n}", "data": b64(n)} for n in names]
    )
    everything = [f"/workspace/{n}" for n in names]

    ascending = [f.path async for f in client.beta.agents.environments.files.list(env.id, order="asc", limit=2)]
    descending = [f.path async for f in client.beta.agents.environments.files.list(env.id, order="desc", limit=3)]
    assert ascending == everything
    assert descending == everything[::-1]

    first_page = await client.beta.agents.environments.files.list(env.id, order="asc", limit=2)
    pages = [[f.path for f in page.data] async for page in first_page.iter_pages()]
    assert pages == [everything[0:2], everything[2:4], everything[4:6], everything[6:7]]

    under_d = [f.path async for f in client.beta.agents.environments.files.list(env.id, path="/workspace/d", limit=1, order="asc")]
    assert under_d == ["/workspace/d/e.txt", "/workspace/d/f.txt", "/workspace/d/g/h.txt"]
    assert [f.path async for f in client.beta.agents.environments.files.list(env.id, path="/workspace/nothing")] == []

    async with stack.http() as http:
        # A token belongs to its path and order.
        token = (await http.get(f"/agents/environments/{env.id}/files", params={"limit": 1, "order": "asc"})).json()["next"]
        mismatch = await http.get(f"/agents/environments/{env.id}/files", params={"limit": 1, "order": "desc", "page": token})
        assert_error(mismatch, 400, "validation_error", param="page")


async def test_unreachable_sandbox_service_surfaces_as_503_and_keeps_the_environment(stack: Stack) -> None:
    client = stack.aclient()
    env = await create_environment(client)
    session = await attach_session(client, env.id)
    await client.beta.agents.environments.files.create(env.id, type="inline", data=b64("before"), path="/workspace/keep.txt")
    sandbox = sandbox_dirs(stack.data_dir)[env.id]

    await stack.stop_sandbox()
    try:
        async with stack.http() as http:
            write = await http.post(
                f"/agents/environments/{env.id}/files",
                json={"type": "inline", "path": "/workspace/after.txt", "data": b64("after")},
            )
            error = assert_error(write, 503, "sandbox_unavailable")
            assert env.id in error["message"]
            assert_error(await http.get(f"/agents/environments/{env.id}/files"), 503, "sandbox_unavailable")

        # A turn that needs the sandbox waits for it, and its events say so.
        known = await send_script(client, session.id, "$ echo during > /workspace/during.txt")
        disconnected = await next_environment_event(stack, session.id, "agent.session.environment.disconnected")
        assert disconnected.environment.status == "disconnected"
        assert disconnected.environment.error is not None and disconnected.environment.error.code == "sandbox_unavailable"

        # Nothing was replaced or marked failed; the session still names the same environment.
        info = await client.beta.agents.environments.retrieve(env.id)
        assert (info.id, info.status, info.lifetime) == (env.id, "ready", "shared")  # type: ignore[attr-defined]
        seen = await client.beta.agents.sessions.retrieve(session.id)
        assert seen.environment.id == env.id  # type: ignore[union-attr]
    finally:
        await stack.start_sandbox()

    # The waiting turn goes on once the service is back.
    turn = await next_turn_end(client, session.id, known)
    assert turn.status == "completed"
    connected = await next_environment_event(stack, session.id, "agent.session.environment.connected")
    assert connected.environment.status == "connected" and connected.turn_id == turn.id
    assert workspace_file(stack.data_dir, env.id, "/workspace/during.txt").read_text() == "during\n"

    # The same sandbox, with its files, answers again once the service is back.
    async def listed() -> list[str] | None:
        try:
            return [f.path async for f in client.beta.agents.environments.files.list(env.id)]
        except openai.InternalServerError as exc:
            assert exc.code == "sandbox_unavailable"
            return None

    listed_paths = await wait_until(listed, timeout=20, what="the sandbox service to answer again")
    assert sorted(listed_paths) == ["/workspace/during.txt", "/workspace/keep.txt"]
    assert sandbox_dirs(stack.data_dir)[env.id] == sandbox
    await client.beta.agents.environments.files.create(env.id, type="inline", data=b64("after"), path="/workspace/after.txt")
    assert workspace_file(stack.data_dir, env.id, "/workspace/keep.txt").read_text() == "before"
    # The session accepts new input against the same environment.
    turn = await run_script(client, session.id, "$ cat /workspace/keep.txt > /workspace/during.txt")
    assert turn.status == "completed"
    assert workspace_file(stack.data_dir, env.id, "/workspace/during.txt").read_text() == "before"


async def test_a_turn_fails_with_both_ids_once_the_sandbox_service_stays_unreachable_past_the_retry_bound(
    tmp_path: Path, bwrap_available: None
) -> None:
    stack, stop = await start_stack(tmp_path / "berth", dependency_retry_s=0.5)
    try:
        client = stack.aclient()
        env = await create_environment(client)
        session = await attach_session(client, env.id)
        await client.beta.agents.environments.files.create(env.id, type="inline", data=b64("x"), path="/workspace/x.txt")
        await stack.stop_sandbox()
        try:
            turn = await run_script(client, session.id, "$ echo during > /workspace/during.txt")
        finally:
            await stack.start_sandbox()
        assert turn.status == "failed"
        assert turn.error is not None and turn.error.code == "sandbox_error"
        assert session.id in turn.error.message and env.id in turn.error.message
        assert (await client.beta.agents.sessions.retrieve(session.id)).status == "idle"
    finally:
        await stop()


async def test_unreachable_sandbox_service_before_setup_leaves_the_environment_pending(stack: Stack) -> None:
    client = stack.aclient()
    env = await create_environment(client, setup_commands=[{"command": "echo once >> /workspace/setup.log"}])

    await stack.stop_sandbox()
    try:
        unavailable = await api_error(client.beta.agents.environments.files.list(env.id))
        assert (unavailable.status_code, unavailable.code) == (503, "sandbox_unavailable")
        info = await client.beta.agents.environments.retrieve(env.id)
        assert (info.id, info.status) == (env.id, "pending")
    finally:
        await stack.start_sandbox()

    assert [f.path async for f in client.beta.agents.environments.files.list(env.id)] == ["/workspace/setup.log"]
    assert (await client.beta.agents.environments.retrieve(env.id)).status == "ready"
    assert workspace_file(stack.data_dir, env.id, "/workspace/setup.log").read_text() == "once\n"
