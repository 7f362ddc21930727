"""Correctness under load: 200 sessions at once, each with a live SSE stream
and a turn running, lose no event and see none twice. Timings live in ``bench scale``; this test only counts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest
from e2e_stack import Stack, start_stack
from turns_support import EVENT_ADAPTER, NO_ENVIRONMENT, SCRIPTED, SseEvent, message, open_events, strict_client

SESSIONS = 200
# Streams and posts of all sessions at once: more connections than httpx's default pool.
_LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=None)


@pytest.fixture(params=[False, True], ids=["polling", "sole_writer"])
async def stack(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Stack]:
    """The stack as deployed, and as ``berth serve`` runs its Session service:
    the only writer of its SQLite database, whose streams hear commits in
    process and do not poll."""
    s, stop = await start_stack(tmp_path / "berth", session_sole_writer=request.param)
    try:
        yield s
    finally:
        await stop()


def _second_turn_idle() -> Callable[[SseEvent], bool]:
    """Accepts the ``agent.session.idle`` after the second turn's end."""
    ended = 0

    def done(event: SseEvent) -> bool:
        nonlocal ended
        if event.type == "agent.session.turn.completed":
            ended += 1
        return ended == 2 and event.type == "agent.session.idle"

    return done


async def test_two_hundred_concurrent_sessions_each_stream_every_event_once_in_order(stack: Stack) -> None:
    client = strict_client(stack)
    headers = {"Authorization": f"Bearer {stack.key}", "OpenAI-Beta": "agents=v1"}
    async with httpx.AsyncClient(base_url=stack.base_url, headers=headers, timeout=60, limits=_LIMITS) as http:

        gate = asyncio.Semaphore(16)

        async def create() -> str:
            async with gate:
                created = await client.beta.agents.sessions.create(agent=SCRIPTED, environment=NO_ENVIRONMENT, input="one")
            return created.id

        async def second_turn(session_id: str) -> list[SseEvent]:
            # From the start: the first turn's events are replayed, the second's arrive live.
            async with open_events(http, session_id, last_event_id="0") as events:
                sent = await http.post(f"/agents/sessions/{session_id}/events", json={"events": [message("two")]})
                assert sent.status_code == 202
                return await events.until(_second_turn_idle())

        ids = await asyncio.gather(*(create() for _ in range(SESSIONS)))
        streamed = await asyncio.wait_for(asyncio.gather(*(second_turn(sid) for sid in ids)), 120)
    for events in streamed:
        # Sequence numbers are the log's positions: 1..n with no gap or repeat is every event, once.
        assert [e.sequence for e in events] == list(range(1, len(events) + 1))
        assert len({e.event_id for e in events}) == len(events)
        assert [e.type for e in events].count("agent.session.turn.created") == 2
    for event in streamed[0]:
        EVENT_ADAPTER.validate_python(event.data)
