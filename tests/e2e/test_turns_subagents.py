"""Subagents (``multi_agent``) end to end through the official SDK with
strict response validation: the scripted model creates a tree of subagents,
waits for them and closes one; the tree is listed and read through
``sessions.subagents``; the concurrency bound, cancellation, deletion and
another organization's view."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import openai
from e2e_stack import Stack, start_stack
from e2e_support import api_error, delete_environment, environment_of, run_script
from openai.types.beta.agents.sessions.turn import Turn
from openai.types.beta.subagent import Subagent
from turns_support import CANCEL, NO_ENVIRONMENT, message, new_turn, strict_client, submit, turn_status
from waiting import wait_until

MULTI: Any = {"model": "scripted", "multi_agent": {"enabled": True}}
DONE = ("completed", "failed", "cancelled")


async def _subagents(client: openai.AsyncOpenAI, session_id: str) -> list[Subagent]:
    return [s async for s in client.beta.agents.sessions.subagents.list(session_id, order="asc")]


async def _items(client: openai.AsyncOpenAI, session_id: str, subagent_id: str) -> list[Any]:
    return [
        i async for i in client.beta.agents.sessions.subagents.items.list(subagent_id, session_id=session_id, order="asc")
    ]


async def _turns(client: openai.AsyncOpenAI, session_id: str, subagent_id: str) -> list[Turn]:
    return [
        t async for t in client.beta.agents.sessions.subagents.turns.list(subagent_id, session_id=session_id, order="asc")
    ]


def _session_rows(stack: Stack) -> int:
    with sqlite3.connect(stack.data_dir / "session.db") as db:
        return int(db.execute("SELECT count(*) FROM sessions").fetchone()[0])


async def test_a_subagent_tree_runs_is_listed_and_is_deleted_with_its_session(stack: Stack) -> None:
    client = strict_client(stack)
    script = (
        "subagent alpha: subagent beta: beta answer\\nsubagent wait\\nalpha answer\n"
        "& subagent gamma: gamma answer\n"
        "subagent wait\n"
        "subagent close gamma\n"
        "all done"
    )
    session = await client.beta.agents.sessions.create(agent=MULTI, environment=NO_ENVIRONMENT, input=script)
    assert session.agent.multi_agent.enabled and session.agent.multi_agent.max_concurrent_subagents == 6
    turn_id = await new_turn(client, session.id, [])
    turn = await turn_status(client, session.id, turn_id, DONE)
    assert (turn.status, turn.subagent_id) == ("completed", None)

    items: list[Any] = [i async for i in client.beta.agents.sessions.turns.items.list(turn_id, session_id=session.id, order="asc")]
    assert [i.type for i in items] == [
        "message",
        "create_subagent_call",
        "create_subagent_call",
        "wait_for_subagents_call",
        "close_subagent_call",
        "message",
    ]
    assert all(getattr(i, "status", "completed") == "completed" for i in items), items
    create_alpha, create_gamma, wait, close = items[1:5]
    assert create_alpha.agent_id == turn.agent_id
    assert create_alpha.content[0].text.startswith("subagent beta:")

    subagents = await _subagents(client, session.id)
    by_name = {s.name or "": s for s in subagents}
    assert sorted(by_name) == ["alpha", "beta", "gamma"]
    alpha, beta, gamma = by_name["alpha"], by_name["beta"], by_name["gamma"]
    assert {s.session_id for s in subagents} == {session.id}
    assert (alpha.parent_agent_id, gamma.parent_agent_id, beta.parent_agent_id) == (turn.agent_id, turn.agent_id, alpha.id)
    assert (alpha.status, alpha.closed_at, gamma.status) == ("active", None, "closed")
    assert gamma.closed_at is not None
    assert wait.recipient_agent_ids == [alpha.id, gamma.id]
    assert (close.recipient_agent_id, close.sender_agent_id) == (gamma.id, turn.agent_id)
    assert (await client.beta.agents.sessions.subagents.retrieve(beta.id, session_id=session.id)).parent_agent_id == alpha.id

    # The parent waited: its children had answered before it finished.
    (alpha_turn,) = await _turns(client, session.id, alpha.id)
    assert (alpha_turn.status, alpha_turn.subagent_id, alpha_turn.agent_id) == ("completed", alpha.id, alpha.id)
    assert alpha_turn.session_id == session.id
    retrieved = await client.beta.agents.sessions.subagents.turns.retrieve(alpha_turn.id, session_id=session.id, subagent_id=alpha.id)
    assert (retrieved.id, retrieved.session_id) == (alpha_turn.id, session.id)
    alpha_items = await _items(client, session.id, alpha.id)
    assert [i.type for i in alpha_items] == ["message", "create_subagent_call", "wait_for_subagents_call", "message"]
    assert alpha_items[-1].content[0].text == "alpha answer"
    beta_turn_items: list[Any] = [
        i
        async for i in client.beta.agents.sessions.subagents.turns.items.list(
            (await _turns(client, session.id, beta.id))[0].id, session_id=session.id, subagent_id=beta.id, order="asc"
        )
    ]
    assert beta_turn_items[-1].content[0].text == "beta answer"

    # Child sessions are subagents, not sessions of the list.
    assert [s.id async for s in client.beta.agents.sessions.list()] == [session.id]
    assert _session_rows(stack) == 4
    # The root's stream announced each subagent of the tree.
    seen: list[tuple[str, str | None]] = []
    async with asyncio.timeout(30):
        stream = await client.beta.agents.sessions.events.stream(session.id, extra_headers={"Last-Event-ID": "0"})
        async with stream:
            async for event in stream:
                if event.type.startswith("agent.session.subagent."):
                    seen.append((event.type, event.subagent.name))  # type: ignore[union-attr]
                if event.type == "agent.session.turn.completed" and event.turn.id == turn_id:  # type: ignore[union-attr]
                    break
    assert sorted(seen) == [
        ("agent.session.subagent.closed", "gamma"),
        ("agent.session.subagent.created", "alpha"),
        ("agent.session.subagent.created", "beta"),
        ("agent.session.subagent.created", "gamma"),
    ]

    await client.beta.agents.sessions.delete(session.id)
    assert _session_rows(stack) == 0
    assert (await api_error(client.beta.agents.sessions.subagents.list(session.id))).status_code == 404


async def test_subagents_beyond_max_concurrent_subagents_are_refused_to_the_model(
    tmp_path: Path, database_url: str, bwrap_available: None
) -> None:
    # The bound is counted under a lock of the root's row: on both databases.
    stack, stop = await start_stack(tmp_path / "berth", session_database_url=database_url)
    try:
        await _bounded(strict_client(stack))
    finally:
        await stop()


async def _bounded(client: openai.AsyncOpenAI) -> None:
    agent: Any = {"model": "scripted", "multi_agent": {"enabled": True, "max_concurrent_subagents": 1}}
    script = (
        "subagent a: one\nsubagent b: two\nsubagent close a\nsubagent send a: late\nsubagent close a\n"
        "subagent resume a\nsubagent c: three\nsubagent wait nobody\nfinished"
    )
    session = await client.beta.agents.sessions.create(agent=agent, environment=NO_ENVIRONMENT, input=script)
    turn = await turn_status(client, session.id, await new_turn(client, session.id, []), DONE)
    assert turn.status == "completed"
    items: list[Any] = [i async for i in client.beta.agents.sessions.turns.items.list(turn.id, session_id=session.id, order="asc")]
    assert [(i.type, getattr(i, "status", None)) for i in items[1:-1]] == [
        ("create_subagent_call", "completed"),
        ("create_subagent_call", "failed"),
        ("close_subagent_call", "completed"),
        # A closed subagent takes no input and cannot be closed again.
        ("send_subagent_input_call", "failed"),
        ("close_subagent_call", "failed"),
        ("resume_subagent_call", "completed"),
        ("create_subagent_call", "failed"),
        # An unknown subagent cannot be waited for.
        ("wait_for_subagents_call", "failed"),
    ]
    subagents = await _subagents(client, session.id)
    assert [(s.name, s.status) for s in subagents] == [("a", "active")]


async def test_cancelling_the_parent_turn_interrupts_its_running_subagent(stack: Stack) -> None:
    client = strict_client(stack)
    session = await client.beta.agents.sessions.create(agent=MULTI, environment={"type": "openai_hosted"})
    known = {t.id async for t in client.beta.agents.sessions.turns.list(session.id)}
    await submit(client, session.id, message("subagent worker: $ sleep 120\nsubagent wait"))
    turn_id = await new_turn(client, session.id, known)

    async def worker_running() -> Any:
        subagents = await _subagents(client, session.id)
        items = await _items(client, session.id, subagents[0].id) if subagents else []
        return subagents[0] if any(i.type == "command_execution" and i.status == "in_progress" for i in items) else None

    worker = await wait_until(worker_running, timeout=60, what="the subagent's command to run")
    # The parent still runs: it is waiting for the subagent.
    assert (await client.beta.agents.sessions.turns.retrieve(turn_id, session_id=session.id)).status == "in_progress"
    assert (await api_error(client.beta.agents.sessions.delete(session.id))).status_code == 409

    await submit(client, session.id, CANCEL)
    assert (await turn_status(client, session.id, turn_id, DONE)).status == "cancelled"

    async def child_cancelled() -> bool:
        (turn,) = await _turns(client, session.id, worker.id)
        return turn.status == "cancelled"

    await wait_until(child_cancelled, timeout=30, what="the subagent's turn to be cancelled")


async def test_a_subagent_shares_the_environment_and_writes_to_its_own_output_directory(stack: Stack) -> None:
    client = strict_client(stack)
    session = await client.beta.agents.sessions.create(agent=MULTI, environment={"type": "openai_hosted"})
    script = "subagent writer: $ echo shared > /workspace/note.txt && echo $REBYTE_OUTPUT_DIR\nsubagent wait\n$ cat /workspace/note.txt"
    turn = await run_script(client, session.id, script, timeout=60)
    assert turn.status == "completed"
    items: list[Any] = [i async for i in client.beta.agents.sessions.turns.items.list(turn.id, session_id=session.id, order="asc")]
    (command,) = [i for i in items if i.type == "command_execution"]
    assert command.output.strip() == "shared"
    (writer,) = await _subagents(client, session.id)
    (child_command,) = [i for i in await _items(client, session.id, writer.id) if i.type == "command_execution"]
    output_dir = child_command.output.strip()
    assert output_dir.startswith("/workspace/outputs/sessions/sess_") and session.id not in output_dir
    environment_id = environment_of(session)
    # Shared by the reference, the environment outlives the sessions until deleted.
    await client.beta.agents.sessions.delete(session.id)
    assert (await delete_environment(client, environment_id))["deleted"] is True


async def test_another_organizations_subagents_are_not_found(stack: Stack) -> None:
    client = strict_client(stack)
    session = await client.beta.agents.sessions.create(agent=MULTI, environment=NO_ENVIRONMENT, input="subagent a: hi\nsubagent wait")
    await turn_status(client, session.id, await new_turn(client, session.id, []), DONE)
    (sub,) = await _subagents(client, session.id)
    (sub_turn,) = await _turns(client, session.id, sub.id)
    other = openai.AsyncOpenAI(base_url=stack.base_url, api_key=await stack.new_key(), max_retries=0, timeout=30)
    subagents = other.beta.agents.sessions.subagents
    calls = [
        subagents.list(session.id),
        subagents.retrieve(sub.id, session_id=session.id),
        subagents.items.list(sub.id, session_id=session.id),
        subagents.turns.list(sub.id, session_id=session.id),
        subagents.turns.retrieve(sub_turn.id, session_id=session.id, subagent_id=sub.id),
        subagents.turns.items.list(sub_turn.id, session_id=session.id, subagent_id=sub.id),
    ]
    for call in calls:
        error = await api_error(call)  # type: ignore[arg-type]
        assert (error.status_code, error.code) == (404, "not_found")
    # Another session of the same organization does not own it either.
    mine = await client.beta.agents.sessions.create(agent=MULTI, environment=NO_ENVIRONMENT, input="hello")
    error = await api_error(client.beta.agents.sessions.subagents.retrieve(sub.id, session_id=mine.id))
    assert (error.status_code, error.code) == (404, "not_found")
