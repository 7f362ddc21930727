"""Context management end to end, through the official SDK with strict
validation against the streaming fake model (``tests/fake_model.py``) with
a small configured context window: a long session compacts and goes on
past the window, background (``async``) compaction, a context-length error
answered by compacting and retrying once, and the compaction item."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from e2e_stack import Stack, start_stack
from fake_model import Answer, FakeModel, Reply, context_overflow
from turns_support import NO_ENVIRONMENT, message, strict_client, submit
from waiting import wait_until

from services.session.harness.compaction import SUMMARY_PROMPT

MODEL = "ctx-model"
WINDOW = 6000
# A real-sized exchange: a user request and an answer of a few KB.
QUESTION = "Please look at part {n} of the report and tell me what changed. " + "Context. " * 40
ANSWER = "Part {n}: " + "the figures moved as expected and nothing else changed. " * 30


def _is_summary_request(body: dict[str, Any]) -> bool:
    messages = body.get("messages") or []
    return bool(messages) and SUMMARY_PROMPT in str(messages[-1].get("content"))


def _answering(body: dict[str, Any]) -> Reply:
    """Summaries for compaction requests; otherwise an answer naming the
    part the last user message asked about."""
    if _is_summary_request(body):
        return Answer(text="Summary: the user asked about report parts; each was answered.", chunk_chars=64)
    last = str(body["messages"][-1].get("content"))
    part = last.split("part ", 1)[1].split(" ", 1)[0] if "part " in last else "?"
    return Answer(text=ANSWER.format(n=part), chunk_chars=4096)


def _tokens(body: dict[str, Any]) -> int:
    """What a request fills, counted like the harness does: JSON characters / 4."""
    return len(json.dumps([body.get("messages"), body.get("tools")], separators=(",", ":"))) // 4


@pytest.fixture
def model() -> Iterator[FakeModel]:
    with FakeModel(respond=_answering) as fake:
        yield fake


@pytest.fixture
async def stack(tmp_path: Path, model: FakeModel) -> AsyncIterator[Stack]:
    stack, stop = await start_stack(
        tmp_path / "berth",
        model_base_url=model.base_url,
        model_api_key="x",
        model_retry_base_delay_s=0.01,
        model_context_windows={MODEL: WINDOW},
    )
    try:
        yield stack
    finally:
        await stop()  # type: ignore[misc]


async def _compactions(client: openai.AsyncOpenAI, session_id: str) -> list[Any]:
    items = [i async for i in client.beta.agents.sessions.items.list(session_id, order="asc", limit=100)]
    return [i for i in items if i.type == "reasoning" and (i.model_extra or {}).get("compaction")]


async def _session(client: openai.AsyncOpenAI, agent: Any) -> str:
    """A session whose first turn (part 0) is queued with it."""
    session = await client.beta.agents.sessions.create(
        agent=agent, environment=NO_ENVIRONMENT, input=QUESTION.format(n=0)
    )
    return session.id


async def _run_turns(client: openai.AsyncOpenAI, session_id: str, first: int, count: int, timeout: float) -> None:
    """Queues ``count`` turns (each message its own turn) and waits for all to complete."""
    for start in range(first, first + count, 50):
        events = [message(QUESTION.format(n=n)) for n in range(start, min(start + 50, first + count))]
        await submit(client, session_id, *events)

    async def done() -> bool:
        # Turns run in order: once the newest one ended, all have.
        newest = (await client.beta.agents.sessions.turns.list(session_id, order="desc", limit=1)).data[0]
        return newest.status in ("completed", "failed", "cancelled")

    await wait_until(done, timeout, what=f"{count} turns to finish")


async def test_a_500_turn_session_compacts_and_goes_on_past_the_context_window(stack: Stack, model: FakeModel) -> None:
    client = strict_client(stack)
    session_id = await _session(client, {"model": MODEL, "instructions": "Be brief."})
    await _run_turns(client, session_id, 1, 499, timeout=240)

    turns = [t async for t in client.beta.agents.sessions.turns.list(session_id, order="asc", limit=100)]
    assert len(turns) == 500 and {t.status for t in turns} == {"completed"}
    compactions = await _compactions(client, session_id)
    # The transcript is far past the window: it was compacted many times.
    assert len(compactions) >= 10
    assert compactions[0].summary[0].text.startswith("Summary:")
    assert compactions[0].model_extra["compaction"]["background"] is False
    assert max(_tokens(b) for b in model.bodies) <= WINDOW
    # The last answer answered the last question, with the summary before it.
    last = model.bodies[-1]["messages"]
    assert "part 499 " in str(last[-1]["content"])
    assert any("[Context compacted]" in str(m.get("content")) for m in last)
    items = [i async for i in client.beta.agents.sessions.turns.items.list(turns[-1].id, session_id=session_id)]
    assert any(i.type == "message" and i.role == "assistant" and "Part 499:" in i.output_text for i in items)


async def test_async_compaction_runs_in_the_background_and_the_session_goes_on(stack: Stack, model: FakeModel) -> None:
    client = strict_client(stack)
    session_id = await _session(client, {"model": MODEL, "compaction": {"async": True}})
    session = await client.beta.agents.sessions.retrieve(session_id)
    assert session.agent.compaction is not None and session.agent.compaction.async_ is True
    await _run_turns(client, session_id, 1, 29, timeout=60)

    turns = [t async for t in client.beta.agents.sessions.turns.list(session_id, order="asc", limit=100)]
    assert len(turns) == 30 and {t.status for t in turns} == {"completed"}
    compactions = await _compactions(client, session_id)
    assert compactions and all(c.model_extra["compaction"]["background"] is True for c in compactions)
    assert max(_tokens(b) for b in model.bodies) <= WINDOW


async def test_a_context_length_error_compacts_the_history_and_retries_the_call_once(
    stack: Stack, model: FakeModel
) -> None:
    client = strict_client(stack)
    # A window the history never reaches by estimate: only the model's refusal compacts.
    session_id = await _session(client, {"model": "gpt-4o"})
    await _run_turns(client, session_id, 1, 2, timeout=30)
    assert not await _compactions(client, session_id)

    model.script = [context_overflow()]
    await _run_turns(client, session_id, 3, 1, timeout=30)
    turns = [t async for t in client.beta.agents.sessions.turns.list(session_id, order="asc")]
    assert [t.status for t in turns] == ["completed"] * 4
    assert len(await _compactions(client, session_id)) == 1
    refused, summary, retried = model.bodies[-3:]
    assert _is_summary_request(summary) and not _is_summary_request(retried)
    assert len(json.dumps(retried["messages"])) < len(json.dumps(refused["messages"]))

    # A second refusal right after the retry fails the turn with the code.
    model.script = [context_overflow(), context_overflow()]
    await _run_turns(client, session_id, 4, 1, timeout=30)
    last = (await client.beta.agents.sessions.turns.list(session_id, order="desc", limit=1)).data[0]
    assert last.status == "failed" and last.error is not None and last.error.code == "context_length_exceeded"


async def test_compaction_settings_are_kept_and_unknown_keys_refused(stack: Stack) -> None:
    client = strict_client(stack)
    blocking = await client.beta.agents.sessions.retrieve(await _session(client, {"model": MODEL, "compaction": {}}))
    assert blocking.agent.compaction is not None and blocking.agent.compaction.async_ is False
    unknown: Any = {"model": MODEL, "compaction": {"async": True, "every": 3}}
    with pytest.raises(openai.BadRequestError) as refused:
        await client.beta.agents.sessions.create(agent=unknown, environment=NO_ENVIRONMENT, input="hello")
    assert refused.value.status_code == 400 and isinstance(refused.value.body, dict)
    assert refused.value.body["param"] == "agent.compaction.every"


@pytest.fixture
async def postgres_stack(tmp_path: Path, model: FakeModel, fresh_postgres_database: str) -> AsyncIterator[Stack]:
    """The same stack with the Session service on PostgreSQL."""
    stack, stop = await start_stack(
        tmp_path / "berth",
        session_database_url=fresh_postgres_database,
        model_base_url=model.base_url,
        model_api_key="x",
        model_context_windows={MODEL: WINDOW},
    )
    try:
        yield stack
    finally:
        await stop()  # type: ignore[misc]


async def test_later_turns_start_from_the_last_summary_on_postgresql(postgres_stack: Stack, model: FakeModel) -> None:
    client = strict_client(postgres_stack)
    session_id = await _session(client, {"model": MODEL})
    await _run_turns(client, session_id, 1, 19, timeout=90)

    compactions = await _compactions(client, session_id)
    assert len(compactions) >= 2
    last = model.bodies[-1]["messages"]
    # The newest summary comes first; the first questions are gone.
    assert "[Context compacted]" in str(last[0]["content"]) and compactions[-1].summary[0].text in str(last[0]["content"])
    assert not any("part 0 " in str(m.get("content")) for m in last)
    assert "part 19 " in str(last[-1]["content"])
    assert max(_tokens(b) for b in model.bodies) <= WINDOW
