"""Two Session service replicas on one PostgreSQL database hear each other's
commits through LISTEN/NOTIFY. The safety-net poll is set to an hour here,
so only a notification (or the listener's resync after a reconnect) can
deliver what these tests wait for."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from session_support import Client, FakeEnvironmentService
from sqlalchemy import event
from sqlalchemy.engine import Engine
from waiting import wait_until

from berth.session.v1 import session_service_pb2
from gateway import render
from services.core.settings import Settings
from services.session.server import start_session_service

pytestmark = pytest.mark.postgres

_LISTENER = "berth_notify_berth_session"
_HOUR_S = 3600.0


@pytest.fixture
async def replicas(
    tmp_path: Path, fresh_postgres_database: str, fake_env: Any, client_for: Any
) -> AsyncIterator[tuple[Client, Client]]:
    settings = Settings(
        data_dir=tmp_path / "data", session_database_url=fresh_postgres_database, notify_safety_poll_s=_HOUR_S
    )
    env_addr = f"127.0.0.1:{fake_env[1].port}"
    a = await start_session_service(settings, address="127.0.0.1:0", environment_addr=env_addr)
    b = await start_session_service(settings, address="127.0.0.1:0", environment_addr=env_addr)
    yield client_for(a.address), client_for(b.address)
    await a.stop(0)
    await b.stop(0)


class Follower:
    """A following stream kept open in the background: every event and keep-alive it received."""

    def __init__(self, client: Client, session_id: str, *, after: int = 0, keepalive_ms: int = 0) -> None:
        self.events: list[tuple[int, dict[str, Any]]] = []
        self.keepalives = 0
        self._call = client.stub.StreamSessionEvents(
            session_service_pb2.StreamSessionEventsRequest(
                session_id=session_id, after_sequence=after, follow=True, keepalive_ms=keepalive_ms
            ),
            metadata=client.md,
        )
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for m in self._call:
            if m.WhichOneof("message") == "keepalive_ms":
                self.keepalives += 1
            for e in m.batch.events:
                self.events.append((e.sequence, render.event(e)))

    def saw(self, event_type: str, turn_id: str = "") -> bool:
        return any(e["type"] == event_type and (not turn_id or e.get("turn_id") == turn_id) for _, e in self.events)

    async def close(self) -> None:
        self._call.cancel()
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


@contextmanager
def statements_about(value: str) -> Iterator[list[str]]:
    """Statements any engine of this process runs with ``value`` among their parameters."""
    seen: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, parameters: Any, _context: Any, _many: bool) -> None:
        if value in repr(parameters):
            seen.append(statement)

    event.listen(Engine, "before_cursor_execute", count)
    try:
        yield seen
    finally:
        event.remove(Engine, "before_cursor_execute", count)


async def listeners(dsn: str) -> list[tuple[int, str]]:
    """The notify listeners connected to the database: (pid, last query)."""
    conn = await asyncpg.connect(dsn, timeout=3)
    try:
        rows = await conn.fetch(
            "SELECT pid, query FROM pg_stat_activity WHERE datname = current_database() AND application_name = $1",
            _LISTENER,
        )
    finally:
        await conn.close()
    return [(int(r["pid"]), str(r["query"])) for r in rows]


async def test_an_event_committed_on_one_replica_reaches_a_follower_on_the_other_without_polling(
    replicas: tuple[Client, Client],
) -> None:
    a, b = replicas
    created = await a.create_session({"agent": {"model": "scripted"}, "environment": {"type": "none"}})
    session_id = created.session.id
    follower = Follower(b, session_id, keepalive_ms=50)
    try:
        # A keep-alive means the follower has read the log and is waiting.
        await wait_until(lambda: follower.keepalives > 0, what="the follower on B is waiting")
        seen = len(follower.events)
        turn_id = await a.say(session_id, "hello")
        await wait_until(lambda: follower.saw("agent.session.turn.completed", turn_id), what="B's follower sees A's turn")
        assert len(follower.events) > seen
    finally:
        await follower.close()


async def test_a_cancel_sent_to_one_replica_reaches_the_turn_running_on_the_other(
    replicas: tuple[Client, Client], fake: FakeEnvironmentService
) -> None:
    a, b = replicas
    created = await a.create_session(
        {"agent": {"model": "scripted"}, "environment": {"type": "openai_hosted"}, "input": "$ echo started; sleep 60"}
    )
    session_id = created.session.id
    await a.wait_for(session_id, lambda e: e["type"] == "agent.output.command_execution_output.delta")
    await b.submit(session_id, {"type": "agent.session.input.cancel"})
    end = await a.wait_turn_end(session_id, created.turn_id, timeout=10.0)
    assert end["type"] == "agent.session.turn.cancelled"
    await asyncio.wait_for(fake.exec_cancelled.wait(), 5.0)


async def test_a_tool_result_sent_to_one_replica_resumes_the_turn_waiting_on_the_other(
    replicas: tuple[Client, Client],
) -> None:
    a, b = replicas
    agent = {"model": "scripted", "tools": [{"type": "function", "name": "hold", "description": "", "parameters": {}}]}
    created = await a.create_session({"agent": agent, "environment": {"type": "none"}, "input": "call hold\nresumed"})
    session_id = created.session.id
    seen = await a.wait_for(session_id, lambda e: e["type"] == "agent.session.requires_action")
    call_id = seen[-1][1]["session"]["required_actions"][0]["call_id"]
    await b.submit(
        session_id,
        {"type": "agent.session.input.tool_result", "turn_id": created.turn_id, "call_id": call_id, "success": True, "output": "ok"},
    )
    end = await a.wait_turn_end(session_id, created.turn_id, timeout=10.0)
    assert end["type"] == "agent.session.turn.completed"


async def test_an_idle_following_stream_sends_keepalives_without_querying_the_database(
    replicas: tuple[Client, Client],
) -> None:
    a, b = replicas
    created = await a.create_session({"agent": {"model": "scripted"}, "environment": {"type": "none"}})
    session_id = created.session.id
    for client in (a, b):
        follower = Follower(client, session_id, keepalive_ms=20)
        try:
            await wait_until(lambda: follower.keepalives > 0, what="the follower is waiting")
            with statements_about(session_id) as statements:
                start = follower.keepalives
                await wait_until(lambda: follower.keepalives >= start + 10, what="ten keep-alives")
            assert statements == []
        finally:
            await follower.close()


async def test_a_killed_listener_reconnects_and_its_followers_miss_nothing(
    replicas: tuple[Client, Client], fresh_postgres_database: str
) -> None:
    a, b = replicas
    dsn = fresh_postgres_database
    agent = {"model": "scripted", "tools": [{"type": "function", "name": "hold", "description": "", "parameters": {}}]}
    created = await a.create_session({"agent": agent, "environment": {"type": "none"}})
    session_id = created.session.id
    follower = Follower(b, session_id, keepalive_ms=50)
    original = {pid for pid, _ in await listeners(dsn)}
    assert len(original) == 2
    killed: set[int] = set()
    stop = asyncio.Event()

    async def kill_listeners() -> None:
        # Keeps every listener down (killed as soon as it reconnects) until told to stop.
        conn = await asyncpg.connect(dsn, timeout=3)
        try:
            while not stop.is_set():
                for pid, _ in await listeners(dsn):
                    await conn.fetchval("SELECT pg_terminate_backend($1)", pid)
                    killed.add(pid)
        finally:
            await conn.close()

    killer = asyncio.create_task(kill_listeners())
    try:
        await wait_until(lambda: follower.keepalives > 0, what="the follower on B is waiting")
        await wait_until(lambda: original <= killed, what="both listeners killed")
        # Committed while the listeners are down: no notification reaches B.
        turn_id = await a.say(session_id, "call hold")
        seen = await a.wait_for(session_id, lambda e: e["type"] == "agent.session.requires_action")
        call_id = seen[-1][1]["session"]["required_actions"][0]["call_id"]
        stop.set()
        await killer
        await wait_until(lambda: follower.saw("agent.session.requires_action"), what="B's follower sees what was committed meanwhile")

        async def listening_again() -> bool:
            now = await listeners(dsn)
            return len(now) == 2 and not killed & {pid for pid, _ in now} and all(q.startswith("LISTEN") for _, q in now)

        await wait_until(listening_again, what="both listeners are back")
        await a.submit(
            session_id,
            {"type": "agent.session.input.tool_result", "turn_id": turn_id, "call_id": call_id, "success": True, "output": "ok"},
        )
        await wait_until(lambda: follower.saw("agent.session.turn.completed", turn_id), what="a turn ending after the reconnect")

        sequences = [seq for seq, _ in follower.events]
        assert sequences == list(range(1, len(sequences) + 1))
        assert [seq for seq, _ in await b.events(session_id)] == sequences
    finally:
        stop.set()
        await asyncio.gather(killer, return_exceptions=True)
        await follower.close()
