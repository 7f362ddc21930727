"""Turns over real HTTP and SSE with the official SDK: the event sequence of
a streamed turn, where each stream ends, the SDK's result helpers, and a
stream that disconnects mid-turn and resumes with ``Last-Event-ID``."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from e2e_stack import Stack
from e2e_support import inline_session
from turns_support import (
    EVENT_ADAPTER,
    EVENT_CLASSES,
    HOSTED,
    SCRIPTED,
    idle_after_turn,
    message,
    open_events,
    strict_client,
    submit,
    turn_status,
)

COUNTDOWN = "$ for i in 1 2 3 4 5; do echo $i; sleep 0.2; done"


def _shape(event: Any) -> tuple[str, str]:
    """An event's type plus, for item events, the item's type (and role)."""
    item = getattr(event, "item", None)
    if item is None:
        return event.type, ""
    return event.type, f"{item.type}:{item.role}" if item.type == "message" else item.type


async def test_a_streamed_turn_sends_its_events_in_lifecycle_order_and_the_sdk_parses_each(stack: Stack) -> None:
    client = strict_client(stack)
    async with asyncio.timeout(60):
        stream = await client.beta.agents.sessions.create(
            agent=SCRIPTED, environment=HOSTED, input="$ echo hi\nall done", stream=True
        )
        events = [event async for event in stream]

    # The creation stream ended on its own: iteration finished right after idle.
    shapes = [_shape(e) for e in events]
    shapes = [s for i, s in enumerate(shapes) if i == 0 or s != shapes[i - 1] or "delta" not in s[0]]
    assert shapes == [
        ("agent.session.created", ""),
        ("agent.session.turn.created", ""),
        ("agent.session.turn.in_progress", ""),
        ("agent.session.in_progress", ""),
        ("agent.session.turn.item.added", "message:user"),
        ("agent.session.environment.pending", ""),
        ("agent.session.environment.ready", ""),
        ("agent.session.turn.item.added", "command_execution"),
        ("agent.output.command_execution_output.delta", ""),
        ("agent.session.turn.item.done", "command_execution"),
        ("agent.session.turn.item.added", "message:assistant"),
        ("agent.session.turn.content_part.added", ""),
        ("agent.session.turn.output_text.delta", ""),
        ("agent.session.turn.output_text.done", ""),
        ("agent.session.turn.content_part.done", ""),
        ("agent.session.turn.item.done", "message:assistant"),
        ("agent.session.turn.completed", ""),
        ("agent.session.idle", ""),
    ]
    for event in events:
        assert type(event) is EVENT_CLASSES[event.type]
    event_ids = [e.event_id for e in events]
    assert len(set(event_ids)) == len(event_ids)

    session_id = events[0].session.id  # type: ignore[union-attr]
    turn_id = events[1].turn_id  # type: ignore[union-attr]
    assert events[1].turn.status == "queued" and events[1].turn.subagent_id is None  # type: ignore[union-attr]
    scoped = [e for e in events if hasattr(e, "session_id")]
    assert {e.session_id for e in scoped} == {session_id}  # type: ignore[attr-defined]
    assert {getattr(e, "turn_id", None) for e in scoped} == {turn_id}
    assert {e.item.turn_id for e in events if hasattr(e, "item")} == {turn_id}  # type: ignore[attr-defined]

    command = next(e.item for e in events if _shape(e) == ("agent.session.turn.item.done", "command_execution"))  # type: ignore[union-attr]
    assert (command.command, command.status, command.exit_code, command.output) == ("echo hi", "completed", 0, "hi\n")  # type: ignore[union-attr]
    answer = next(e for e in events if _shape(e) == ("agent.session.turn.item.done", "message:assistant"))
    assert [p.text for p in answer.item.content] == ["all done"]  # type: ignore[union-attr]
    assert answer.item.phase == "final_answer" and answer.output_index > 0  # type: ignore[union-attr, operator]
    completed, idle = events[-2], events[-1]
    assert completed.turn.status == "completed" and completed.turn.id == turn_id  # type: ignore[union-attr]
    assert idle.session.status == "idle" and idle.session.id == session_id  # type: ignore[union-attr]

    turn = await client.beta.agents.sessions.turns.retrieve(turn_id, session_id=session_id)
    assert (turn.status, turn.session_id) == ("completed", session_id)


async def test_a_streamed_session_creation_yields_the_final_output_through_get_final_result(stack: Stack) -> None:
    client = strict_client(stack)
    async with asyncio.timeout(60):
        stream = await client.beta.agents.sessions.create(
            agent=SCRIPTED, environment=HOSTED, input="$ echo working\nthe answer", stream=True
        )
        result = await stream.get_final_result()

    assert result.output_text == "the answer"
    assert result.turn.status == "completed"
    assert [m.phase for m in result.messages] == ["final_answer"]
    assert (await client.beta.agents.sessions.retrieve(result.session_id)).status == "idle"


async def test_the_sessions_stream_helper_yields_the_submitted_turns_final_output(stack: Stack) -> None:
    client = strict_client(stack)
    session = await inline_session(client)
    async with asyncio.timeout(60):
        async with client.beta.agents.sessions.stream(session.id, input="$ echo working\nfirst answer") as turn:
            result = await turn.get_final_result()

    assert result.output_text == "first answer"
    assert (result.session_id, result.turn.status) == (session.id, "completed")


async def test_iterating_the_sessions_stream_helper_ends_at_the_idle_after_the_turn(stack: Stack) -> None:
    client = strict_client(stack)
    session = await inline_session(client)
    async with asyncio.timeout(60):
        async with client.beta.agents.sessions.stream(session.id, input="only words") as turn:
            kinds = [event.type async for event in turn]

    assert "agent.session.turn.created" in kinds
    assert kinds[-2:] == ["agent.session.turn.completed", "agent.session.idle"]


async def test_the_sessions_stream_helper_on_a_later_turn_yields_only_that_turn(stack: Stack) -> None:
    client = strict_client(stack)
    session = await inline_session(client)
    async with asyncio.timeout(60):
        for answer in ("first answer", "second answer"):
            async with client.beta.agents.sessions.stream(session.id, input=answer) as turn:
                events = [event async for event in turn.with_result_collection()]
                result = await turn.get_final_result()
            assert events[0].type == "agent.session.turn.created"
            assert result.output_text == answer


async def test_a_stream_disconnected_mid_turn_resumes_from_last_event_id_without_gaps_or_duplicates(stack: Stack) -> None:
    client = strict_client(stack)
    session = await inline_session(client)

    async with stack.http() as http, asyncio.timeout(60):
        async with open_events(http, session.id, last_event_id="0") as live:
            await submit(client, session.id, message(COUNTDOWN))
            before = await live.until(lambda e: e.type == "agent.output.command_execution_output.delta")
            turn_id = before[-1].data["turn_id"]
        # Disconnected while the command still counts: the turn keeps running.
        assert not any(e.type.startswith("agent.session.turn.completed") for e in before)
        await turn_status(client, session.id, turn_id, "completed")

        async with open_events(http, session.id, last_event_id=str(before[-1].sequence)) as resumed:
            after = await resumed.until(idle_after_turn(turn_id))
        async with open_events(http, session.id, last_event_id="0") as replay:
            full = await replay.until(idle_after_turn(turn_id))

    joined = before + after
    assert [e.sequence for e in joined] == list(range(1, len(joined) + 1))
    assert [(e.sequence, e.event_id) for e in joined] == [(e.sequence, e.event_id) for e in full]
    assert len({e.event_id for e in joined}) == len(joined)
    for event in joined:
        assert event.type == event.data["type"]
        EVENT_ADAPTER.validate_python(event.data)
    output = "".join(e.data["delta"] for e in joined if e.type == "agent.output.command_execution_output.delta")
    assert output == "1\n2\n3\n4\n5\n"
    assert [e.type for e in after[-2:]] == ["agent.session.turn.completed", "agent.session.idle"]


async def test_a_subscriber_naming_any_earlier_sequence_receives_every_later_event_once(stack: Stack) -> None:
    client = strict_client(stack)
    session = await inline_session(client)
    async with stack.http() as http, asyncio.timeout(60):
        async with open_events(http, session.id, last_event_id="0") as live:
            await submit(client, session.id, message("$ echo one\nfirst"))
            await live.until(lambda e: e.type == "agent.session.idle")
        log = list(live.received)

        for cut in (1, len(log) // 2, log[-1].sequence):
            high = log[-1].sequence
            async with open_events(http, session.id, last_event_id=str(cut)) as resumed:
                await submit(client, session.id, message(f"cut at {cut}"))
                tail = await resumed.until(lambda e: e.type == "agent.session.idle" and e.sequence > high)
            assert [e.sequence for e in tail] == list(range(cut + 1, tail[-1].sequence + 1))
            assert [e.event_id for e in tail if e.sequence <= high] == [e.event_id for e in log[cut:]]
            log += [e for e in tail if e.sequence > high]
