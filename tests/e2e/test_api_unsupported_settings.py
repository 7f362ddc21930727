"""Settings and tool types the SDK offers but Berth does not implement are
refused with a 400 naming them, at agent creation and update and at session
creation and update, and nothing is written. Asserted through the official
SDK with strict parsing."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from e2e_stack import Stack
from turns_support import strict_client

FUNCTION: dict[str, Any] = {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}}

# (what, agent settings, the param named relative to the agent).
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("web_search", {"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ("computer_use", {"tools": [FUNCTION, {"type": "computer_use"}]}, "tools.1.type"),
    ("programmatic_tool_calling", {"tools": [{"type": "programmatic_tool_calling", "enabled": True}]}, "tools.0.type"),
    ("tool_search", {"tools": [{"type": "tool_search"}]}, "tools.0.type"),
    ("a deferred function", {"tools": [{**FUNCTION, "defer_loading": True}]}, "tools.0.defer_loading"),
    ("an asynchronous function", {"tools": [{**FUNCTION, "async": True}]}, "tools.0.async"),
    ("an unknown tool key", {"tools": [{**FUNCTION, "strict": True}]}, "tools.0.strict"),
    ("an unknown multi_agent key", {"multi_agent": {"enabled": True, "depth": 2}}, "multi_agent.depth"),
    ("an unknown compaction key", {"compaction": {"async": True, "mode": "x"}}, "compaction.mode"),
    ("an unknown reasoning key", {"reasoning": {"effort": "low", "budget": 3}}, "reasoning.budget"),
    ("an unknown experimental key", {"experimental": {"time_travel": True}}, "experimental.time_travel"),
]
# What a session's agent snapshot can change.
SESSION_UPDATABLE = [case for case in REFUSED if "tools" in case[1]]


def _check(error: openai.BadRequestError, param: str) -> None:
    assert error.status_code == 400
    assert isinstance(error.body, dict) and error.body["param"] == param and error.body["type"] == "invalid_request_error"


@pytest.mark.parametrize(("what", "settings", "param"), REFUSED, ids=[c[0] for c in REFUSED])
async def test_an_unsupported_setting_is_refused_at_agent_creation_and_update(
    stack: Stack, what: str, settings: dict[str, Any], param: str
) -> None:
    client = strict_client(stack)
    with pytest.raises(openai.BadRequestError) as created:
        await client.beta.agents.create(model="scripted", **settings)
    _check(created.value, param)
    assert [a async for a in client.beta.agents.list()] == []

    agent = await client.beta.agents.create(model="scripted", name="kept")
    with pytest.raises(openai.BadRequestError) as updated:
        await client.beta.agents.update(agent.id, **settings)
    _check(updated.value, param)
    after = await client.beta.agents.retrieve(agent.id)
    assert after.model_dump() == agent.model_dump()


@pytest.mark.parametrize(("what", "settings", "param"), REFUSED, ids=[c[0] for c in REFUSED])
async def test_an_unsupported_setting_is_refused_at_session_creation(
    stack: Stack, what: str, settings: dict[str, Any], param: str
) -> None:
    client = strict_client(stack)
    agent: Any = {"model": "scripted", **settings}
    with pytest.raises(openai.BadRequestError) as error:
        await client.beta.agents.sessions.create(agent=agent, environment={"type": "none"}, input="hello")
    _check(error.value, f"agent.{param}")
    assert [s async for s in client.beta.agents.sessions.list()] == []


@pytest.mark.parametrize(("what", "settings", "param"), SESSION_UPDATABLE, ids=[c[0] for c in SESSION_UPDATABLE])
async def test_an_unsupported_tool_is_refused_at_session_update(stack: Stack, what: str, settings: dict[str, Any], param: str) -> None:
    client = strict_client(stack)
    session = await client.beta.agents.sessions.create(agent={"model": "scripted"}, environment={"type": "none"}, input="hi")
    with pytest.raises(openai.BadRequestError) as error:
        await client.beta.agents.sessions.update(session.id, agent=settings)  # type: ignore[arg-type]
    _check(error.value, f"agent.{param}")
    after = await client.beta.agents.sessions.retrieve(session.id)
    assert after.agent.tools == []


@pytest.mark.parametrize(
    ("body", "param"),
    [({"review": "auto_review"}, "review")],
)
async def test_unsupported_session_options_are_refused_at_creation_and_update(stack: Stack, body: dict[str, Any], param: str) -> None:
    client = strict_client(stack)
    with pytest.raises(openai.BadRequestError) as created:
        await client.beta.agents.sessions.create(agent={"model": "scripted"}, environment={"type": "none"}, input="hi", **body)
    _check(created.value, param)
    session = await client.beta.agents.sessions.create(agent={"model": "scripted"}, environment={"type": "none"}, input="hi")
    with pytest.raises(openai.BadRequestError) as updated:
        await client.beta.agents.sessions.update(session.id, **body)
    _check(updated.value, param)


async def test_what_berth_implements_is_still_accepted(stack: Stack) -> None:
    client = strict_client(stack)
    agent = await client.beta.agents.create(
        model="scripted",
        tools=[{**FUNCTION, "defer_loading": False, "async": False}],  # type: ignore[list-item]
        multi_agent={"enabled": False},
        experimental={"time_awareness": True},
        reasoning={"effort": "low", "summary": "auto"},
    )
    assert agent.experimental is not None and agent.experimental.time_awareness is True
    session = await client.beta.agents.sessions.create(agent_id=agent.id, environment={"type": "none"}, input="hi", review="none")
    assert session.agent.model == "scripted"
