"""The HTTP side of the turn benchmarks (``bench turn``, ``bench scale``): a
session on the scripted model with its own environment, its SSE stream, and
``$ true`` turns driven through it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

__all__ = ["SCRIPT", "TurnStream", "create_session", "turn_stream"]

SCRIPT = "$ true"
_MESSAGE = {
    "events": [
        {
            "type": "agent.session.input.message",
            "input": [{"role": "user", "content": [{"type": "input_text", "text": SCRIPT}]}],
        }
    ]
}


_ENDED = ("agent.session.turn.completed", "agent.session.turn.failed", "agent.session.turn.cancelled")


async def create_session(http: httpx.AsyncClient) -> dict[str, Any]:
    created = await http.post("/agents/sessions", json={"agent": {"model": "scripted"}, "environment": {"type": "openai_hosted"}})
    created.raise_for_status()
    return dict(created.json())


class TurnStream:
    """A session's open SSE stream: turns are posted and awaited through it.
    Each frame's sequence must be the next one; a frame that is not counts
    as a repeat or a gap."""

    def __init__(self, http: httpx.AsyncClient, session_id: str, lines: AsyncIterator[str]) -> None:
        self._http = http
        self._session_id = session_id
        self._lines = lines
        self.last = 0
        self.repeats = 0
        self.gaps = 0

    async def until(self, *kinds: str) -> str:
        """Reads frames up to one whose type is one of ``kinds``; returns that type."""
        sequence, seen = -1, ""
        async for line in self._lines:
            if line.startswith("id: "):
                sequence = int(line[4:])
            elif line.startswith("event: "):
                seen = line[7:]
            elif line == "" and seen:
                if sequence <= self.last:
                    self.repeats += 1
                elif sequence != self.last + 1:
                    self.gaps += 1
                self.last = max(self.last, sequence)
                if seen in kinds:
                    return seen
                seen = ""
        raise RuntimeError("the event stream ended")

    async def turn(self) -> None:
        """Posts ``$ true`` and waits for its ``turn.completed``; a turn that
        ends otherwise raises."""
        sent = await self._http.post(f"/agents/sessions/{self._session_id}/events", json=_MESSAGE)
        if sent.status_code != 202:
            raise RuntimeError(f"input refused: {sent.status_code} {sent.text}")
        ended = await self.until(*_ENDED)
        if ended != _ENDED[0]:
            raise RuntimeError(f"a benchmark turn of {self._session_id} ended with {ended}")


@asynccontextmanager
async def turn_stream(http: httpx.AsyncClient, session_id: str) -> AsyncIterator[TurnStream]:
    """The session's stream from its first event."""
    async with http.stream("GET", f"/agents/sessions/{session_id}/events", headers={"Last-Event-ID": "0"}, timeout=None) as response:
        response.raise_for_status()
        yield TurnStream(http, session_id, response.aiter_lines())
