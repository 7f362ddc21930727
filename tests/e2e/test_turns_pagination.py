"""Turns and items as lists through the SDK: small pages, the SDK's
auto-pagination in both orders, the conversation-cursor page of a turn's
items, and turn shapes under strict validation."""

from __future__ import annotations

import openai
from e2e_stack import Stack
from e2e_support import inline_session, run_script
from openai.types.beta.agent_session import AgentSession
from openai.types.beta.agents.sessions.turn import Turn
from turns_support import strict_client

SCRIPTS = ("$ echo one\nfirst", "$ echo two\nsecond", "$ echo three\nthird")


async def _three_turns(stack: Stack) -> tuple[openai.AsyncOpenAI, AgentSession, list[Turn]]:
    client = strict_client(stack)
    session = await inline_session(client)
    turns = [await run_script(client, session.id, script) for script in SCRIPTS]
    assert [t.status for t in turns] == ["completed"] * 3
    return client, session, turns


async def test_items_paged_two_at_a_time_auto_paginate_to_every_item_in_order(stack: Stack) -> None:
    client, session, turns = await _three_turns(stack)
    items = client.beta.agents.sessions.items

    everything = [i async for i in items.list(session.id, order="asc", limit=100)]
    assert [(i.type, i.turn_id) for i in everything] == [
        (kind, turn.id) for turn in turns for kind in ("message", "command_execution", "message")
    ]
    assert [getattr(i, "role", None) for i in everything] == ["user", None, "assistant"] * 3
    assert len({i.id for i in everything}) == len(everything)

    first_page = await items.list(session.id, order="asc", limit=2)
    assert [i.id for i in first_page.data] == [i.id for i in everything[:2]]
    assert first_page.has_more is True
    second_page = await first_page.get_next_page()
    assert [i.id for i in second_page.data] == [i.id for i in everything[2:4]]

    assert [i.id async for i in items.list(session.id, order="asc", limit=2)] == [i.id for i in everything]
    assert [i.id async for i in items.list(session.id, order="desc", limit=2)] == [i.id for i in reversed(everything)]
    # The default order is newest first.
    assert [i.id async for i in items.list(session.id, limit=4)] == [i.id for i in reversed(everything)]

    last_page = await items.list(session.id, order="asc", limit=2, after=everything[-2].id)  # type: ignore[arg-type]
    assert ([i.id for i in last_page.data], last_page.has_more) == ([everything[-1].id], False)


async def test_a_turns_items_page_with_the_conversation_cursor(stack: Stack) -> None:
    client, session, turns = await _three_turns(stack)
    middle = turns[1]
    items = client.beta.agents.sessions.turns.items

    page = await items.list(middle.id, session_id=session.id, order="asc", limit=1)
    assert page.has_more is True and page.last_id == page.data[0].id
    paged = [i async for i in items.list(middle.id, session_id=session.id, order="asc", limit=1)]
    assert [i.type for i in paged] == ["message", "command_execution", "message"]
    assert {i.turn_id for i in paged} == {middle.id}
    assert paged[1].output == "two\n"  # type: ignore[union-attr]
    assert paged[2].content[0].text == "second"  # type: ignore[union-attr]


async def test_turns_list_and_retrieve_parse_as_sdk_turns(stack: Stack) -> None:
    client, session, turns = await _three_turns(stack)

    listed = [t async for t in client.beta.agents.sessions.turns.list(session.id, limit=1)]
    assert [t.id for t in listed] == [t.id for t in reversed(turns)]
    ascending = [t async for t in client.beta.agents.sessions.turns.list(session.id, order="asc", limit=2)]
    assert [t.id for t in ascending] == [t.id for t in turns]

    for turn in ascending:
        again = await client.beta.agents.sessions.turns.retrieve(turn.id, session_id=session.id)
        assert again == turn
        assert (turn.object, turn.session_id, turn.status, turn.subagent_id, turn.error) == (
            "agent.session.turn",
            session.id,
            "completed",
            None,
            None,
        )
        assert turn.agent_id == session.agent.id
        assert turn.created_at <= turn.started_at <= turn.completed_at  # type: ignore[operator]
        assert turn.usage is not None and turn.usage.total_tokens > 0

    page = await client.beta.agents.sessions.turns.list(session.id, order="asc", limit=2)
    assert page.has_more is True
    assert [t.id for t in (await page.get_next_page()).data] == [turns[2].id]
