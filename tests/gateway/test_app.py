from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from gateway.app import start_gateway
from gateway_support import Stack
from hosts_support import free_port
from services.core.db import Database, create_engine
from services.core.settings import Settings


async def test_start_gateway_fails_cleanly_when_its_database_cannot_open(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    settings = Settings(data_dir=tmp_path, gateway_database_url=f"sqlite:///{blocker}/gateway.db")
    with pytest.raises(RuntimeError):
        await start_gateway(settings, port=0, host="127.0.0.1")


async def test_start_gateway_raises_when_the_port_is_taken(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):
            await start_gateway(Settings(data_dir=tmp_path), port=taken.getsockname()[1], host="127.0.0.1")


async def test_stopping_the_gateway_ends_open_event_streams(stack: Stack) -> None:
    fake = stack.session.add_session(stack.org_id)
    stack.session.append(fake, "agent.session.created")
    stack.session.hold_stream = asyncio.Event()
    async with stack.client() as client, client.stream("GET", f"/v1/agents/sessions/{fake.session.id}/events") as response:
        chunks = response.aiter_text()
        first = await anext(chunks)
        await asyncio.wait_for(stack.gateway.stop(), timeout=5)
        rest = [chunk async for chunk in chunks]
    assert first.startswith("id: 1\n") and "".join(rest) == ""


async def test_a_gateway_whose_own_database_is_unreachable_answers_503_in_the_error_envelope_not_500(stack: Stack) -> None:
    closed = free_port()
    state = stack.gateway.app.state.berth
    working = state.db
    # Nothing listens there: every key lookup finds its connection refused.
    state.db = Database(create_engine(f"postgresql+asyncpg://postgres@127.0.0.1:{closed}/gone"))
    try:
        async with stack.client() as client:
            response = await client.get("/v1/agents")
    finally:
        await state.db.dispose()
        state.db = working
    assert response.status_code == 503
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "service_unavailable")
