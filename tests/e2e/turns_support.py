"""Helpers of the end-to-end turn tests (``test_turns_*.py``): a strictly
validating SDK client, input events, a raw SSE reader for precise control
over connections and ``Last-Event-ID``, the SDK's event union, a host view of
a session's sandbox processes, and a tiny OpenAI-compatible model server."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, get_args

import httpx
import openai
import pydantic
from e2e_stack import Stack
from openai.types.beta.agent_session import AgentSession
from openai.types.beta.agent_session_event import AgentSessionEvent
from openai.types.beta.agents import session_create_params
from openai.types.beta.agents.sessions.turn import Turn
from waiting import wait_until

SCRIPTED: session_create_params.Agent = {"model": "scripted"}
HOSTED: Any = {"type": "openai_hosted"}
NO_ENVIRONMENT: Any = {"type": "none"}
CANCEL = {"type": "agent.session.input.cancel"}

EVENT_ADAPTER: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(AgentSessionEvent)


def _event_classes() -> dict[str, type[Any]]:
    union = get_args(AgentSessionEvent)[0]
    classes: dict[str, type[Any]] = {}
    for cls in get_args(union):
        for literal in get_args(cls.model_fields["type"].annotation):
            classes[literal] = cls
    return classes


# Every event type of the SDK's AgentSessionEvent union, with its model class.
EVENT_CLASSES = _event_classes()


def strict_client(stack: Stack) -> openai.AsyncOpenAI:
    """The official client with strict response validation: a missing required
    field, a bad literal or an unknown event type raises instead of parsing
    leniently."""
    return openai.AsyncOpenAI(
        base_url=stack.base_url, api_key=stack.key, max_retries=0, timeout=30, _strict_response_validation=True
    )


def message(text: str) -> dict[str, Any]:
    return {
        "type": "agent.session.input.message",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": text}]}],
    }


async def submit(client: openai.AsyncOpenAI, session_id: str, *events: dict[str, Any]) -> None:
    await client.beta.agents.sessions.events.create(session_id, events=list(events))  # type: ignore[arg-type]


async def turn_ids(client: openai.AsyncOpenAI, session_id: str) -> list[str]:
    """The session's turns, oldest first."""
    return [t.id async for t in client.beta.agents.sessions.turns.list(session_id, order="asc")]


async def new_turn(client: openai.AsyncOpenAI, session_id: str, known: list[str] | set[str]) -> str:
    """The ID of the one turn created since ``known`` was taken."""

    async def created() -> str | None:
        fresh = [t for t in await turn_ids(client, session_id) if t not in known]
        return fresh[0] if len(fresh) == 1 else None

    return await wait_until(created, timeout=15, what="the new turn")


async def turn_status(
    client: openai.AsyncOpenAI, session_id: str, turn_id: str, status: str | tuple[str, ...], *, timeout: float = 30.0
) -> Turn:
    """Polls the turn until it has (one of) ``status``."""
    wanted = (status,) if isinstance(status, str) else status

    async def reached() -> Turn | None:
        turn = await client.beta.agents.sessions.turns.retrieve(turn_id, session_id=session_id)
        return turn if turn.status in wanted else None

    return await wait_until(reached, timeout=timeout, what=f"turn {turn_id} to be {'/'.join(wanted)}")


async def session_status(
    client: openai.AsyncOpenAI, session_id: str, status: str, *, timeout: float = 30.0
) -> AgentSession:
    async def reached() -> AgentSession | None:
        session = await client.beta.agents.sessions.retrieve(session_id)
        return session if session.status == status else None

    return await wait_until(reached, timeout=timeout, what=f"session {session_id} to be {status}")


# --- raw server-sent events ---------------------------------------------------------------


@dataclass(frozen=True)
class SseEvent:
    """One SSE frame of the session event stream."""

    sequence: int
    type: str
    data: dict[str, Any]

    @property
    def event_id(self) -> str:
        return str(self.data["event_id"])


@dataclass
class SseReader:
    """Reads frames from one open response, line by line, so a test decides
    exactly when to stop reading and close the connection."""

    lines: AsyncIterator[str]
    received: list[SseEvent] = field(default_factory=list)

    async def next(self) -> SseEvent:
        fields: dict[str, list[str]] = {}
        async for line in self.lines:
            if line.startswith(":"):
                continue  # a keep-alive comment
            if line:
                name, _, value = line.partition(":")
                fields.setdefault(name, []).append(value[1:] if value.startswith(" ") else value)
                continue
            if "data" not in fields:
                continue
            data = json.loads("\n".join(fields["data"]))
            event = SseEvent(int(fields["id"][0]), fields["event"][0], data)
            self.received.append(event)
            return event
        raise AssertionError("the event stream ended")

    async def until(self, done: Callable[[SseEvent], bool]) -> list[SseEvent]:
        """Reads frames up to and including the first one ``done`` accepts."""
        out: list[SseEvent] = []
        while True:
            event = await self.next()
            out.append(event)
            if done(event):
                return out


@asynccontextmanager
async def open_events(http: httpx.AsyncClient, session_id: str, *, last_event_id: str | None) -> AsyncIterator[SseReader]:
    """``GET .../events`` read raw; leaving the block closes the connection."""
    headers = {"Accept": "text/event-stream"}
    if last_event_id is not None:
        headers["Last-Event-ID"] = last_event_id
    async with http.stream("GET", f"/agents/sessions/{session_id}/events", headers=headers, timeout=60) as response:
        assert response.status_code == 200, response.status_code
        assert response.headers["content-type"].startswith("text/event-stream")
        yield SseReader(response.aiter_lines())


def idle_after_turn(turn_id: str) -> Callable[[SseEvent], bool]:
    """Accepts the ``agent.session.idle`` that follows the end of ``turn_id``."""
    ended = False

    def done(event: SseEvent) -> bool:
        nonlocal ended
        if event.type.startswith("agent.session.turn.") and event.data.get("turn_id") == turn_id:
            ended = ended or event.type in (
                "agent.session.turn.completed",
                "agent.session.turn.failed",
                "agent.session.turn.cancelled",
            )
        return ended and event.type == "agent.session.idle"

    return done


# --- the host's view of a session's processes -----------------------------------------------


def session_processes(session_id: str) -> list[tuple[int, list[str]]]:
    """(pid, argv) of every live host process started by a command of this
    session: sandbox processes are host processes (in a PID namespace), and
    each command's environment carries ``REBYTE_SESSION_ID``."""
    marker = f"REBYTE_SESSION_ID={session_id}".encode()
    found: list[tuple[int, list[str]]] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as environ:
                if marker not in environ.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                argv = [a.decode(errors="replace") for a in cmdline.read().split(b"\0") if a]
            with open(f"/proc/{entry}/stat", "rb") as stat:
                state = stat.read().rsplit(b")", 1)[-1].split()[0]
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if state != b"Z":
            found.append((int(entry), argv))
    return found
