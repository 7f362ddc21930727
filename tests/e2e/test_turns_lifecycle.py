"""How turns end and queue, end to end: cancelling a running command (and
what it leaves running), FIFO queueing of input that arrives during a turn,
outcomes a late cancel cannot replace, deletion of a busy session, and a
cancel while a peer session waits on the shared environment's setup."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from e2e_stack import Stack
from e2e_support import (
    api_error,
    assert_error,
    attach_session,
    create_environment,
    inline_session,
    run_script,
    sandbox_dirs,
    setup_commands,
    workspace_file,
)
from turns_support import (
    CANCEL,
    HOSTED,
    SCRIPTED,
    idle_after_turn,
    message,
    new_turn,
    open_events,
    session_processes,
    session_status,
    strict_client,
    submit,
    turn_ids,
    turn_status,
)
from waiting import wait_until

TERMINAL = ("completed", "failed", "cancelled")
TICKER = "$ nohup sh -c 'while true; do date +%s%N > /workspace/tick; sleep 0.2; done' >/dev/null 2>&1 &"


def _gate(name: str) -> str:
    """A command that waits (bounded) until the test creates /workspace/<name>."""
    return f"$ i=0; while [ ! -f /workspace/{name} ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done; test -f /workspace/{name}"


def _sleeping(session_id: str) -> list[int]:
    return [pid for pid, argv in session_processes(session_id) if argv == ["sleep", "60"]]


async def test_cancel_during_a_long_command_ends_the_turn_within_two_seconds_and_kills_only_that_command(stack: Stack) -> None:
    client = strict_client(stack)
    session = await inline_session(client)
    ticker = await run_script(client, session.id, TICKER)
    assert ticker.status == "completed"
    tick = workspace_file(stack.data_dir, session.environment.id, "/workspace/tick")  # type: ignore[union-attr]

    known = await turn_ids(client, session.id)
    await submit(client, session.id, message("$ echo started; sleep 60\nnever said"))
    turn_id = await new_turn(client, session.id, known)
    await wait_until(lambda: _sleeping(session.id), timeout=15, what="sleep 60 to start")

    cancelled_at = time.monotonic()
    await submit(client, session.id, CANCEL)
    turn = await turn_status(client, session.id, turn_id, TERMINAL, timeout=2.0)
    assert turn.status == "cancelled"
    assert time.monotonic() - cancelled_at < 2.0
    assert (await client.beta.agents.sessions.retrieve(session.id)).status == "idle"

    # No sleep 60 survives the cancel; the ticker from an earlier turn does.
    await wait_until(lambda: not _sleeping(session.id), timeout=5, what="sleep 60 to be gone")
    ticking = [argv for _, argv in session_processes(session.id) if argv[:2] == ["sh", "-c"] and "tick" in argv[-1]]
    assert len(ticking) == 1, session_processes(session.id)
    seen = tick.read_text()
    await wait_until(lambda: tick.read_text() != seen, timeout=5, what="the ticker to tick again")

    items = [i async for i in client.beta.agents.sessions.turns.items.list(turn_id, session_id=session.id)]
    (command,) = [i for i in items if i.type == "command_execution"]
    assert command.status == "incomplete"  # type: ignore[union-attr]
    assert not [i for i in items if i.type == "message" and i.role == "assistant"]  # type: ignore[union-attr]

    # The session takes the next turn, in the same sandbox.
    after = await run_script(client, session.id, "$ cat /workspace/tick > /dev/null")
    assert after.status == "completed"


async def test_a_cancelled_turn_streams_its_end_and_publishes_nothing(stack: Stack) -> None:
    client = strict_client(stack)
    session = await inline_session(client)
    async with stack.http() as http, asyncio.timeout(30):
        async with open_events(http, session.id, last_event_id="0") as events:
            await submit(client, session.id, message("$ echo partial > $REBYTE_OUTPUT_DIR/partial.txt; echo go; sleep 60"))
            turn_id = (await events.until(lambda e: e.type == "agent.output.command_execution_output.delta"))[-1].data[
                "turn_id"
            ]
            await submit(client, session.id, CANCEL)
            tail = await events.until(idle_after_turn(turn_id))

    kinds = [e.type for e in tail]
    assert kinds[-2:] == ["agent.session.turn.cancelled", "agent.session.idle"]
    done = [e.data["item"] for e in tail if e.type == "agent.session.turn.item.done"]
    assert [(i["type"], i["status"]) for i in done] == [("command_execution", "incomplete")]
    assert tail[-2].data["turn"]["status"] == "cancelled"
    assert [a async for a in client.beta.agents.sessions.artifacts.list(session.id)] == []


async def test_messages_sent_during_a_turn_queue_and_run_next_in_order(stack: Stack) -> None:
    client = strict_client(stack)
    session = await inline_session(client)
    await submit(client, session.id, message(_gate("go") + "\nfirst"))
    first = await new_turn(client, session.id, [])
    await turn_status(client, session.id, first, "in_progress")

    await submit(client, session.id, message("$ echo second >> /workspace/order\nsecond"))
    second = await new_turn(client, session.id, [first])
    await submit(client, session.id, message("$ echo third >> /workspace/order\nthird"))
    third = await new_turn(client, session.id, [first, second])
    for queued in (second, third):
        assert (await client.beta.agents.sessions.turns.retrieve(queued, session_id=session.id)).status == "queued"

    # The first turn is in progress from before its sandbox exists (setup).
    async def sandbox_exists() -> Path | None:
        return sandbox_dirs(stack.data_dir).get(session.environment.id)  # type: ignore[union-attr]

    await wait_until(sandbox_exists, timeout=15, what="the session's sandbox")
    workspace_file(stack.data_dir, session.environment.id, "/workspace/go").touch()  # type: ignore[union-attr]
    turns = [await turn_status(client, session.id, t, TERMINAL) for t in (first, second, third)]
    assert [t.status for t in turns] == ["completed"] * 3
    assert turns[0].completed_at <= turns[1].started_at <= turns[1].completed_at <= turns[2].started_at  # type: ignore[operator]
    order = workspace_file(stack.data_dir, session.environment.id, "/workspace/order").read_text()  # type: ignore[union-attr]
    assert order == "second\nthird\n"

    async with stack.http() as http, asyncio.timeout(30):
        async with open_events(http, session.id, last_event_id="0") as events:
            log = await events.until(idle_after_turn(third))
    lifecycle = [
        (e.type, e.data["turn_id"])
        for e in log
        if e.type in ("agent.session.turn.created", "agent.session.turn.in_progress", "agent.session.turn.completed")
    ]
    assert lifecycle == [
        ("agent.session.turn.created", first),
        ("agent.session.turn.in_progress", first),
        ("agent.session.turn.created", second),
        ("agent.session.turn.created", third),
        ("agent.session.turn.completed", first),
        ("agent.session.turn.in_progress", second),
        ("agent.session.turn.completed", second),
        ("agent.session.turn.in_progress", third),
        ("agent.session.turn.completed", third),
    ]
    answers = [
        i.content[0].text  # type: ignore[union-attr]
        async for i in client.beta.agents.sessions.items.list(session.id, order="asc")
        if i.type == "message" and i.role == "assistant"  # type: ignore[union-attr]
    ]
    assert answers == ["first", "second", "third"]


async def test_a_cancel_after_a_turn_completed_leaves_it_completed(stack: Stack) -> None:
    client = strict_client(stack)
    session = await inline_session(client)
    done = await run_script(client, session.id, "$ echo done\nfinished")
    assert done.status == "completed"

    await submit(client, session.id, CANCEL)

    assert (await client.beta.agents.sessions.turns.retrieve(done.id, session_id=session.id)).status == "completed"
    assert (await client.beta.agents.sessions.retrieve(session.id)).status == "idle"
    async with stack.http() as http, asyncio.timeout(30):
        async with open_events(http, session.id, last_event_id="0") as events:
            await submit(client, session.id, message("later"))
            later = await new_turn(client, session.id, [done.id])
            log = await events.until(idle_after_turn(later))
    assert "agent.session.turn.cancelled" not in [e.type for e in log]
    assert (await client.beta.agents.sessions.turns.retrieve(later, session_id=session.id)).status == "completed"


async def test_a_cancel_after_a_turn_failed_leaves_it_failed(stack: Stack) -> None:
    client = strict_client(stack)
    session = await client.beta.agents.sessions.create(
        agent=SCRIPTED, environment={"type": "openai_hosted", "setup_commands": setup_commands("exit 3")}
    )
    failed = await run_script(client, session.id, "$ echo never")
    assert (failed.status, failed.error.code) == ("failed", "sandbox_error")  # type: ignore[union-attr]

    await submit(client, session.id, CANCEL)

    assert (await client.beta.agents.sessions.turns.retrieve(failed.id, session_id=session.id)).status == "failed"
    assert (await client.beta.agents.sessions.retrieve(session.id)).status == "failed"


async def test_deleting_a_session_with_a_running_turn_is_409_session_in_progress(stack: Stack) -> None:
    client = strict_client(stack)
    session = await inline_session(client)
    await submit(client, session.id, message("$ sleep 60"))
    turn_id = await new_turn(client, session.id, [])
    await wait_until(lambda: _sleeping(session.id), timeout=15, what="sleep 60 to start")

    async with stack.http() as http:
        busy = await http.delete(f"/agents/sessions/{session.id}")
        assert_error(busy, 409, "session_in_progress")
        assert busy.headers.get("x-should-retry") == "false"
    refused = await api_error(client.beta.agents.sessions.delete(session.id))
    assert (refused.status_code, refused.code) == (409, "session_in_progress")
    assert (await client.beta.agents.sessions.turns.retrieve(turn_id, session_id=session.id)).status == "in_progress"

    await submit(client, session.id, CANCEL)
    await turn_status(client, session.id, turn_id, "cancelled", timeout=5)
    assert (await client.beta.agents.sessions.delete(session.id)).deleted is True
    gone = await api_error(client.beta.agents.sessions.retrieve(session.id))
    assert gone.status_code == 404


async def test_a_session_with_queued_turns_cannot_be_deleted_until_the_queue_drained(stack: Stack) -> None:
    client = strict_client(stack)
    session = await inline_session(client)
    await submit(client, session.id, message(_gate("go")))
    first = await new_turn(client, session.id, [])
    await submit(client, session.id, message("queued"))
    second = await new_turn(client, session.id, [first])

    refused = await api_error(client.beta.agents.sessions.delete(session.id))
    assert (refused.status_code, refused.code) == (409, "session_in_progress")

    # A cancel ends the active turn only; the queued one then runs.
    await submit(client, session.id, CANCEL)
    assert (await turn_status(client, session.id, first, TERMINAL)).status == "cancelled"
    assert (await turn_status(client, session.id, second, TERMINAL)).status == "completed"
    await session_status(client, session.id, "idle")
    assert (await client.beta.agents.sessions.delete(session.id)).deleted is True


async def test_cancelling_the_turn_that_started_setup_lets_a_peer_turn_wait_for_setup_and_run(stack: Stack) -> None:
    client = strict_client(stack)
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

    await submit(client, starter.id, message("$ echo starter >> /workspace/ran.log"))
    starter_turn = await new_turn(client, starter.id, [])

    async def setup_running() -> bool:
        return env.id in sandbox_dirs(stack.data_dir) and workspace_file(
            stack.data_dir, env.id, "/workspace/setup.log"
        ).exists()

    await wait_until(setup_running, timeout=15, what="the starter's turn to start setup")
    await submit(client, peer.id, message("$ echo peer >> /workspace/ran.log\npeer done"))
    peer_turn = await new_turn(client, peer.id, [])
    async with stack.http() as http, asyncio.timeout(30):
        async with open_events(http, peer.id, last_event_id="0") as events:
            await events.until(lambda e: e.type == "agent.session.environment.pending")

    await submit(client, starter.id, CANCEL)
    assert (await turn_status(client, starter.id, starter_turn, TERMINAL, timeout=5)).status == "cancelled"
    # Setup carries on for the peer, whose turn still waits on it.
    assert (await client.beta.agents.environments.retrieve(env.id)).status == "pending"
    assert (await client.beta.agents.sessions.turns.retrieve(peer_turn, session_id=peer.id)).status == "in_progress"

    workspace_file(stack.data_dir, env.id, "/workspace/release").touch()
    assert (await turn_status(client, peer.id, peer_turn, TERMINAL)).status == "completed"
    assert (await client.beta.agents.environments.retrieve(env.id)).status == "ready"

    # The cancelled session submits another turn against the same environment.
    again = await run_script(client, starter.id, "$ echo starter >> /workspace/ran.log")
    assert again.status == "completed"
    assert workspace_file(stack.data_dir, env.id, "/workspace/ran.log").read_text() == "peer\nstarter\n"
    assert workspace_file(stack.data_dir, env.id, "/workspace/setup.log").read_text() == "setup\n"
    for session in (starter, peer):
        assert (await client.beta.agents.sessions.retrieve(session.id)).status == "idle"
    assert [a async for a in client.beta.agents.sessions.artifacts.list(starter.id)] == []


async def test_a_session_created_with_input_runs_its_turn_without_a_subscriber(stack: Stack) -> None:
    client = strict_client(stack)
    session = await client.beta.agents.sessions.create(
        agent=SCRIPTED, environment=HOSTED, input="$ echo unattended > /workspace/u.txt\nok"
    )
    (turn_id,) = await turn_ids(client, session.id)
    assert (await turn_status(client, session.id, turn_id, TERMINAL)).status == "completed"
    assert workspace_file(stack.data_dir, session.environment.id, "/workspace/u.txt").read_text() == "unattended\n"  # type: ignore[union-attr]
