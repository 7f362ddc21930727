"""``review`` and ``spend_control`` on sessions, through the official SDK
with strict response validation: stored, returned and applied on create and
update. A turn that reaches the budget stops with ``session_budget_exceeded``
before its tool calls run, and the session pauses (``budget_reached``): it
refuses new input with 409 ``spend_limit_reached`` and holds its queued
turns until the limit is raised."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import asyncio

import pytest
import pytest_asyncio
from e2e_stack import Stack, running_stack
from e2e_support import TERMINAL_TURN_EVENTS, api_error, assert_error, next_turn_end, run_script
from openai.types.beta.agents.sessions.turn import Turn
from turns_support import NO_ENVIRONMENT, new_turn, strict_client, turn_status

from services.core.settings import ModelPrice

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory, bwrap_available: None) -> AsyncIterator[Stack]:
    # One cent per output token of the offline model; input is free.
    prices = {"scripted": ModelPrice(input=0, cached_input=0, output=10_000)}
    async with running_stack(tmp_path_factory.mktemp("controls") / "berth", model_prices=prices) as s:
        yield s


def _message(text: str) -> dict[str, Any]:
    return {"type": "agent.session.input.message", "input": [{"role": "user", "content": [{"type": "input_text", "text": text}]}]}


async def _log_until(client: Any, session_id: str, count: int, event_type: str) -> list[Any]:
    """The session's log from its first event through the ``count``-th event
    of ``event_type``."""
    seen: list[Any] = []
    async with asyncio.timeout(30):
        stream = await client.beta.agents.sessions.events.stream(session_id, extra_headers={"Last-Event-ID": "0"})
        async with stream:
            async for event in stream:
                seen.append(event)
                if sum(e.type == event_type for e in seen) == count:
                    return seen
    raise AssertionError("the stream ended first")


def _after(events: list[Any], turn_id: str) -> list[str]:
    """The types of the events that follow ``turn_id``'s end."""
    ends = [i for i, e in enumerate(events) if e.type in TERMINAL_TURN_EVENTS and e.turn_id == turn_id]
    return [e.type for e in events[ends[0] + 1 :]]


async def test_a_turn_reaching_the_spend_limit_pauses_the_session_until_the_limit_is_raised(stack: Stack) -> None:
    client = strict_client(stack)
    sessions = client.beta.agents.sessions
    session = await sessions.create(
        agent={"model": "scripted"},
        environment={"type": "openai_hosted"},
        review="none",
        spend_control={"limit": 5},
    )
    assert session.review == "none"
    assert (session.status, session.spend_control.limit, session.spend_control.consumed) == ("idle", 5, 0)

    # Two turns: the first reaches the budget, the second is queued behind it.
    await sessions.events.create(session.id, events=[_message("$ echo one\n$ echo two\n$ echo three"), _message("all done")])  # type: ignore[list-item]
    turn = await next_turn_end(client, session.id, set())
    assert turn.status == "failed"
    assert turn.error is not None and turn.error.code == "session_budget_exceeded"
    items = [i async for i in sessions.items.list(session.id)]
    assert [i.type for i in items if i.type == "command_execution"] == []  # stopped before its tool calls

    log = await _log_until(client, session.id, 1, "agent.session.budget_reached")
    assert _after(log, turn.id) == ["agent.session.budget_reached"]  # in place of agent.session.idle
    paused = await sessions.retrieve(session.id)
    assert log[-1].session.status == paused.status == "budget_reached"  # type: ignore[union-attr]
    # One cent per output token: consumed is the spend, in whole cents.
    assert paused.usage is not None and paused.usage.output_tokens >= 5
    assert paused.spend_control.consumed == paused.usage.output_tokens
    queued = [t async for t in sessions.turns.list(session.id, order="asc")]
    assert [t.status for t in queued] == ["failed", "queued"]  # the queued turn waits

    async with stack.http() as http:
        refused = await http.post(f"/agents/sessions/{session.id}/events", json={"events": [_message("more")]})
        assert_error(refused, 409, "spend_limit_reached")
    assert len([t async for t in sessions.turns.list(session.id)]) == 2

    # Raised past the spend: idle again, and the queued turn runs.
    raised = await sessions.update(session.id, spend_control={"limit": 1_000_000})
    assert raised.spend_control.limit == 1_000_000
    assert raised.review == "none"  # omitted: kept
    resumed = await turn_status(client, session.id, queued[1].id, ("completed", "failed", "cancelled"))
    assert resumed.status == "completed"
    log = await _log_until(client, session.id, 2, "agent.session.idle")
    assert _after(log, turn.id)[:2] == ["agent.session.budget_reached", "agent.session.idle"]

    # Lowered to what was spent: paused at once, without a turn.
    spent = (await sessions.retrieve(session.id)).spend_control.consumed
    assert spent is not None and spent >= 5
    lowered = await sessions.update(session.id, spend_control={"limit": spent})
    assert (lowered.status, lowered.spend_control.limit) == ("budget_reached", spent)
    log = await _log_until(client, session.id, 2, "agent.session.budget_reached")
    assert log[-1].session.status == "budget_reached"  # type: ignore[union-attr]

    # A null limit removes it, as a null spend_control does, and resumes the session.
    unlimited = await sessions.update(session.id, spend_control={"limit": None})
    assert (unlimited.status, unlimited.spend_control.limit) == ("idle", None)
    assert unlimited.spend_control.consumed == spent  # removing the limit keeps the spend
    await sessions.update(session.id, spend_control={"limit": 1_000_000})
    cleared = await sessions.update(session.id, review=None, spend_control=None)  # type: ignore[arg-type]
    assert cleared.review is None and cleared.spend_control.limit is None
    assert (await run_script(client, session.id, "still fine")).status == "completed"


async def test_a_session_paused_at_its_budget_is_deleted_with_its_queued_turns(stack: Stack) -> None:
    client = strict_client(stack)
    sessions = client.beta.agents.sessions
    session = await sessions.create(agent={"model": "scripted"}, environment={"type": "openai_hosted"}, spend_control={"limit": 2})
    await sessions.events.create(session.id, events=[_message("$ echo one\n$ echo two"), _message("later")])  # type: ignore[list-item]
    await _log_until(client, session.id, 1, "agent.session.budget_reached")
    assert [t.status async for t in sessions.turns.list(session.id, order="asc")] == ["failed", "queued"]
    deleted = await sessions.delete(session.id)
    assert deleted.deleted is True
    async with stack.http() as http:
        assert (await http.get(f"/agents/sessions/{session.id}")).status_code == 404


async def test_a_streamed_creation_ends_at_the_budget_reached_event_of_its_turn(stack: Stack) -> None:
    client = strict_client(stack)
    async with asyncio.timeout(30):
        stream = await client.beta.agents.sessions.create(
            agent={"model": "scripted"},
            environment=NO_ENVIRONMENT,
            input="$ echo one\n$ echo two",
            spend_control={"limit": 2},
            stream=True,
        )
        events = [e async for e in stream]
    types = [e.type for e in events]
    assert types[-2:] == ["agent.session.turn.failed", "agent.session.budget_reached"], types
    assert "agent.session.idle" not in types[types.index("agent.session.turn.in_progress") :]


async def test_spend_control_and_review_that_berth_cannot_apply_are_refused(stack: Stack) -> None:
    client = strict_client(stack)
    sessions = client.beta.agents.sessions
    async with stack.http() as http:

        async def create(**body: Any) -> Any:
            return await http.post("/agents/sessions", json={"agent": {"model": "scripted"}, "environment": {"type": "openai_hosted"}, **body})

        assert_error(await create(spend_control={"limit": 0}), 400, "validation_error", param="spend_control.limit")
        assert_error(await create(spend_control={"limit": 5, "currency": "eur"}), 400, "validation_error")
        assert_error(await create(review="auto_review"), 400, "validation_error", param="review")
        unpriced = await http.post(
            "/agents/sessions",
            json={"agent": {"model": "unpriced-model"}, "environment": {"type": "openai_hosted"}, "spend_control": {"limit": 5}},
        )
        assert_error(unpriced, 400, "validation_error", param="spend_control.limit")
    before = [s.id async for s in sessions.list()]
    session = await sessions.create(agent={"model": "scripted"}, environment={"type": "openai_hosted"})
    assert session.review is None and session.spend_control.limit is None
    refused = await api_error(sessions.update(session.id, review="auto_review"))
    assert (refused.status_code, refused.code) == (400, "validation_error")
    moved = await api_error(
        sessions.update(session.id, agent={"model": "unpriced-model"}, extra_body={"spend_control": {"limit": 3}})
    )
    assert (moved.status_code, moved.code) == (400, "validation_error")
    assert (await sessions.retrieve(session.id)).agent.model == "scripted"
    assert [s.id async for s in sessions.list()] == [session.id, *before]


async def test_stream_events_carry_obfuscation_padding_unless_the_stream_opts_out(stack: Stack) -> None:
    client = strict_client(stack)
    session = await client.beta.agents.sessions.create(agent={"model": "scripted"}, environment={"type": "openai_hosted"})
    turn = await run_script(client, session.id, "a final answer long enough to stream in several deltas")
    assert turn.status == "completed"

    async def events(**options: Any) -> list[Any]:
        seen = []
        stream = await client.beta.agents.sessions.events.stream(
            session.id, extra_headers={"Last-Event-ID": "0"}, **options
        )
        async with stream:
            async for event in stream:
                seen.append(event)
                if event.type == "agent.session.turn.completed":
                    return seen
        raise AssertionError("the stream ended before the turn did")

    padded = await events()
    assert any(e.type == "agent.session.turn.output_text.delta" for e in padded)
    for event in padded:
        padding = getattr(event, "obfuscation", None)
        assert isinstance(padding, str) and (padding == "" or padding.isalnum()), event
    assert len({e.obfuscation for e in padded}) > 1  # type: ignore[union-attr]
    plain = await events(include_obfuscation=False)
    assert [getattr(e, "obfuscation", None) for e in plain] == [None] * len(padded)


async def _tree_spend(client: Any, session_id: str) -> tuple[int, int, list[Any]]:
    """(root's output tokens, its subagents' output tokens, their turns)."""
    sessions = client.beta.agents.sessions
    root = await sessions.retrieve(session_id)
    child_turns = [
        t
        async for s in sessions.subagents.list(session_id)
        async for t in sessions.subagents.turns.list(s.id, session_id=session_id)
    ]
    children = sum(t.usage.output_tokens for t in child_turns if t.usage is not None)
    return (root.usage.output_tokens if root.usage else 0), children, child_turns


async def _tree_turn(client: Any, script: str, limit: int) -> tuple[str, Turn]:
    """A session of a multi-agent agent with budget ``limit`` whose first
    turn runs ``script``: (its ID, that turn once it ended)."""
    session = await client.beta.agents.sessions.create(
        agent={"model": "scripted", "multi_agent": {"enabled": True}},
        environment=NO_ENVIRONMENT,
        input=script,
        extra_body={"spend_control": {"limit": limit}},
    )
    turn_id = await new_turn(client, session.id, [])
    return session.id, await turn_status(client, session.id, turn_id, ("completed", "failed", "cancelled"))


async def test_subagents_spend_their_root_sessions_budget(stack: Stack) -> None:
    client = strict_client(stack)
    script = "subagent a: " + "w " * 100 + "\nsubagent wait\nfinished"

    # Control: under a budget it never reaches, the tree completes; what the
    # root and its subagent each spent sets a limit between the larger of
    # the two and their sum.
    roomy, done = await _tree_turn(client, script, 1_000_000)
    assert done.status == "completed", done
    root_tokens, child_tokens, _ = await _tree_spend(client, roomy)
    assert root_tokens > 0 and child_tokens > 0
    limit = max(root_tokens, child_tokens) + min(root_tokens, child_tokens) // 2

    tight, turn = await _tree_turn(client, script, limit)
    assert turn.status == "failed" and turn.error is not None and turn.error.code == "session_budget_exceeded", turn
    _, _, child_turns = await _tree_spend(client, tight)
    assert [(t.status, t.error.code if t.error else None) for t in child_turns] == [("failed", "session_budget_exceeded")]
    # The root session pauses at its tree's budget.
    assert (await client.beta.agents.sessions.retrieve(tight)).status == "budget_reached"
    async with stack.http() as http:
        refused = await http.post(
            f"/agents/sessions/{tight}/events",
            json={"events": [{"type": "agent.session.input.message", "input": [{"role": "user", "content": [{"type": "input_text", "text": "more"}]}]}]},
        )
        assert_error(refused, 409, "spend_limit_reached")


async def test_a_subagent_on_a_model_without_a_price_is_refused_under_a_budget(stack: Stack) -> None:
    client = strict_client(stack)
    session_id, turn = await _tree_turn(client, "subagent a/unpriced-model: hello\nsubagent b: hello\ndone", 1_000_000)
    assert turn.status == "completed", turn
    items: Any = [i async for i in client.beta.agents.sessions.turns.items.list(turn.id, session_id=session_id, order="asc")]
    assert [(i.type, getattr(i, "status", None)) for i in items[1:3]] == [
        ("create_subagent_call", "failed"),
        ("create_subagent_call", "completed"),  # control: a priced model is created
    ]
    assert [s.name async for s in client.beta.agents.sessions.subagents.list(session_id)] == ["b"]
