"""Artifacts of completed turns through the SDK: publication of the output
directory, the result-scoped artifact helper, immutability, isolation between
sessions and organizations, and removal with the session."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import openai
import pytest
from e2e_stack import Stack
from e2e_support import api_error, assert_error, environment_of, inline_session, run_script
from openai.lib.beta.agents import AgentTurnResult
from turns_support import HOSTED, SCRIPTED, strict_client


async def _run(client: openai.AsyncOpenAI, session_id: str, script: str) -> AgentTurnResult:
    """One completed turn, as the result the SDK's artifact helper scopes to."""
    turn = await run_script(client, session_id, script, timeout=60)
    assert turn.status == "completed", turn
    return AgentTurnResult(turn=turn, messages=[])


async def test_a_command_writing_to_the_output_directory_publishes_an_artifact_of_its_bytes(stack: Stack, tmp_path: Path) -> None:
    client = strict_client(stack)
    async with asyncio.timeout(60):
        stream = await client.beta.agents.sessions.create(
            agent=SCRIPTED, environment=HOSTED, input="$ echo hi > $REBYTE_OUTPUT_DIR/a.txt", stream=True
        )
        result = await stream.get_final_result()
    session = await client.beta.agents.sessions.retrieve(result.session_id)

    artifacts = [a async for a in client.beta.agents.sessions.artifacts.list(session.id)]
    assert [(a.path, a.size_bytes, a.session_id, a.turn_id, a.environment_id) for a in artifacts] == [
        ("/workspace/outputs/a.txt", 3, session.id, result.turn_id, environment_of(session))
    ]
    (artifact,) = artifacts
    assert (await client.beta.agents.sessions.artifacts.retrieve(artifact.id, session_id=session.id)) == artifact
    content = await client.beta.agents.sessions.artifacts.content(artifact.id, session_id=session.id)
    assert content.read() == b"hi\n"

    of_result = client.beta.agents.sessions.artifacts.for_result(result)
    assert (await of_result.content("/workspace/outputs/a.txt")).read() == b"hi\n"
    downloaded = await of_result.download("/workspace/outputs/a.txt", to=tmp_path / "a.txt")
    assert downloaded.id == artifact.id
    assert (tmp_path / "a.txt").read_bytes() == b"hi\n"


async def test_published_artifacts_keep_their_bytes_when_the_output_file_changes_or_goes(stack: Stack) -> None:
    client = strict_client(stack)
    session = await inline_session(client)
    first = await _run(client, session.id, "$ echo v1 > $REBYTE_OUTPUT_DIR/report.txt")
    second = await _run(client, session.id, "$ echo version-2 > $REBYTE_OUTPUT_DIR/report.txt")
    unchanged = await _run(client, session.id, "$ touch /workspace/unrelated")
    removed = await _run(client, session.id, "$ rm $REBYTE_OUTPUT_DIR/report.txt")

    artifacts = [a async for a in client.beta.agents.sessions.artifacts.list(session.id, order="asc")]
    assert [(a.turn_id, a.size_bytes) for a in artifacts] == [(first.turn_id, 3), (second.turn_id, 10)]
    path = "/workspace/outputs/report.txt"
    assert (await client.beta.agents.sessions.artifacts.for_result(first).content(path)).read() == b"v1\n"
    assert (await client.beta.agents.sessions.artifacts.for_result(second).content(path)).read() == b"version-2\n"
    for later in (unchanged, removed):
        # Turns that left the file alone (or removed it) published nothing.
        with pytest.raises(ValueError):
            await client.beta.agents.sessions.artifacts.for_result(later).content(path)


async def test_another_sessions_artifact_is_not_found_through_this_session_or_another_org(stack: Stack) -> None:
    client = strict_client(stack)
    mine = await inline_session(client)
    theirs = await inline_session(client)
    await _run(client, mine.id, "$ echo mine > $REBYTE_OUTPUT_DIR/mine.txt")
    await _run(client, theirs.id, "$ echo theirs > $REBYTE_OUTPUT_DIR/theirs.txt")
    (their_artifact,) = [a async for a in client.beta.agents.sessions.artifacts.list(theirs.id)]

    assert [a.path async for a in client.beta.agents.sessions.artifacts.list(mine.id)] == ["/workspace/outputs/mine.txt"]
    foreign = await api_error(client.beta.agents.sessions.artifacts.retrieve(their_artifact.id, session_id=mine.id))
    assert (foreign.status_code, foreign.code) == (404, "not_found")
    async with stack.http() as http:
        response = await http.get(f"/agents/sessions/{mine.id}/artifacts/{their_artifact.id}/content")
        assert_error(response, 404, "not_found")

    other_org = stack.http(await stack.new_key("org-b"))
    async with other_org as http:
        assert_error(await http.get(f"/agents/sessions/{theirs.id}/artifacts"), 404, "not_found")
        assert_error(await http.get(f"/agents/sessions/{theirs.id}/artifacts/{their_artifact.id}"), 404, "not_found")
        response = await http.get(f"/agents/sessions/{theirs.id}/artifacts/{their_artifact.id}/content")
        assert_error(response, 404, "not_found")


async def test_artifacts_live_as_long_as_their_session_and_go_with_it(stack: Stack) -> None:
    client = strict_client(stack)
    doomed = await inline_session(client)
    kept = await inline_session(client)
    await _run(client, doomed.id, "$ echo doomed > $REBYTE_OUTPUT_DIR/out.txt")
    await _run(client, kept.id, "$ echo kept > $REBYTE_OUTPUT_DIR/out.txt")
    (gone,) = [a async for a in client.beta.agents.sessions.artifacts.list(doomed.id)]
    (stays,) = [a async for a in client.beta.agents.sessions.artifacts.list(kept.id)]

    # Later turns of the private inline session do not disturb earlier artifacts.
    await _run(client, doomed.id, "$ rm -rf /workspace/outputs")
    assert [a.id async for a in client.beta.agents.sessions.artifacts.list(doomed.id)] == [gone.id]

    blobs = Path(stack.settings.data_dir).resolve() / "artifacts"
    doomed_blob = blobs / hashlib.sha256(b"doomed\n").hexdigest()[:2] / hashlib.sha256(b"doomed\n").hexdigest()
    assert doomed_blob.is_file()

    deleted = await client.beta.agents.sessions.delete(doomed.id)
    assert (deleted.id, deleted.deleted) == (doomed.id, True)
    async with stack.http() as http:
        assert_error(await http.get(f"/agents/sessions/{doomed.id}/artifacts"), 404, "not_found")
        assert_error(await http.get(f"/agents/sessions/{doomed.id}/artifacts/{gone.id}"), 404, "not_found")
        assert_error(await http.get(f"/agents/sessions/{doomed.id}/artifacts/{gone.id}/content"), 404, "not_found")
    assert not doomed_blob.exists()

    content = await client.beta.agents.sessions.artifacts.content(stays.id, session_id=kept.id)
    assert content.read() == b"kept\n"
