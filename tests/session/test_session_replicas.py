"""Two Session service replicas on one database (SQLite and PostgreSQL):
sequence numbers stay gapless under concurrent writers, a stream served by
one replica sees events another produces, and cancels and tool results
reach a turn running on the other replica."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from session_support import FakeEnvironmentService

from services.core.settings import Settings
from services.session.server import start_session_service


@pytest.fixture
async def replicas(tmp_path: Path, database_url: str, fake_env: Any, client_for: Any) -> AsyncIterator[tuple[Any, Any]]:
    settings = Settings(data_dir=tmp_path / "data", session_database_url=database_url)
    env_addr = f"127.0.0.1:{fake_env[1].port}"
    a = await start_session_service(settings, address="127.0.0.1:0", environment_addr=env_addr)
    b = await start_session_service(settings, address="127.0.0.1:0", environment_addr=env_addr)
    yield client_for(a.address), client_for(b.address)
    await a.stop(0)
    await b.stop(0)


async def test_concurrent_input_on_two_replicas_keeps_sequences_gapless(replicas: tuple[Any, Any]) -> None:
    a, b = replicas
    created = await a.create_session({"agent": {"model": "scripted"}, "environment": {"type": "none"}})
    session_id = created.session.id
    turn_ids = await asyncio.gather(*(client.say(session_id, f"message {i}") for i in range(4) for client in (a, b)))
    for turn_id in turn_ids:
        end = await b.wait_turn_end(session_id, turn_id)
        assert end["type"] == "agent.session.turn.completed"
    events = await a.events(session_id)
    assert [seq for seq, _ in events] == list(range(1, len(events) + 1))
    for _, event in events:
        a.validate(event)
    answers = [i["content"][0]["text"] for i in await a.items(session_id) if i.get("role") == "assistant"]
    assert sorted(answers) == sorted(f"message {i}" for i in range(4) for _ in range(2))


async def test_a_stream_on_one_replica_follows_a_turn_cancelled_through_the_other(replicas: tuple[Any, Any], fake: FakeEnvironmentService) -> None:
    a, b = replicas
    created = await a.create_session({"agent": {"model": "scripted"}, "environment": {"type": "openai_hosted"}, "input": "$ echo started; sleep 60"})
    session_id = created.session.id
    await b.wait_for(session_id, lambda e: e["type"] == "agent.output.command_execution_output.delta")
    await b.submit(session_id, {"type": "agent.session.input.cancel"})
    end = await b.wait_turn_end(session_id, created.turn_id, timeout=3.0)
    assert end["type"] == "agent.session.turn.cancelled"
    await asyncio.wait_for(fake.exec_cancelled.wait(), 2.0)


async def test_a_tool_result_sent_to_another_replica_resumes_the_turn(replicas: tuple[Any, Any]) -> None:
    a, b = replicas
    agent = {"model": "scripted", "tools": [{"type": "function", "name": "hold", "description": "", "parameters": {}}]}
    created = await a.create_session({"agent": agent, "environment": {"type": "none"}, "input": "call hold\nresumed"})
    session_id = created.session.id
    seen = await b.wait_for(session_id, lambda e: e["type"] == "agent.session.requires_action")
    call_id = seen[-1][1]["session"]["required_actions"][0]["call_id"]
    await b.submit(
        session_id,
        {"type": "agent.session.input.tool_result", "turn_id": created.turn_id, "call_id": call_id, "success": True, "output": "ok"},
    )
    end = await b.wait_turn_end(session_id, created.turn_id)
    assert end["type"] == "agent.session.turn.completed"


async def test_a_turn_waiting_for_a_function_result_is_taken_over_after_a_restart_and_resumed_by_the_result(
    tmp_path: Path, database_url: str, fake_env: Any, client_for: Any
) -> None:
    settings = Settings(data_dir=tmp_path / "data", session_database_url=database_url, turn_lease_s=0.6)
    env_addr = f"127.0.0.1:{fake_env[1].port}"
    first = await start_session_service(settings, address="127.0.0.1:0", environment_addr=env_addr)
    client = client_for(first.address)
    agent = {"model": "scripted", "tools": [{"type": "function", "name": "hold", "description": "", "parameters": {}}]}
    created = await client.create_session({"agent": agent, "environment": {"type": "none"}, "input": "call hold\nresumed"})
    session_id = created.session.id
    seen = await client.wait_for(session_id, lambda e: e["type"] == "agent.session.requires_action")
    call_id = seen[-1][1]["session"]["required_actions"][0]["call_id"]
    await first.stop(0)

    second = await start_session_service(settings, address="127.0.0.1:0", environment_addr=env_addr)
    try:
        client = client_for(second.address)
        await client.submit(
            session_id,
            {"type": "agent.session.input.tool_result", "turn_id": created.turn_id, "call_id": call_id, "success": True, "output": "ok"},
        )
        end = await client.wait_turn_end(session_id, created.turn_id, timeout=15.0)
        assert end["type"] == "agent.session.turn.completed"
        backlog = await client.events(session_id)
        assert [seq for seq, _ in backlog] == list(range(1, len(backlog) + 1))
        types = [e["type"] for _, e in backlog]
        assert types.count("agent.session.requires_action") == 1
        assert types.count("agent.session.turn.completed") == 1
        assert types[-1] == "agent.session.idle"
        items = await client.items(session_id)
        assert [(i["type"], i.get("status")) for i in items if i["type"].startswith("function_call")] == [
            ("function_call", "completed"),
            ("function_call_output", "completed"),
        ]
        answers = [i["content"][0]["text"] for i in items if i.get("role") == "assistant"]
        assert answers == ["resumed"]

        # The usage counts the model call the first worker made, as a turn run by one worker does.
        control = await client.create_session({"agent": agent, "environment": {"type": "none"}, "input": "call hold\nresumed"})
        seen = await client.wait_for(control.session.id, lambda e: e["type"] == "agent.session.requires_action")
        await client.submit(
            control.session.id,
            {
                "type": "agent.session.input.tool_result",
                "turn_id": control.turn_id,
                "call_id": seen[-1][1]["session"]["required_actions"][0]["call_id"],
                "success": True,
                "output": "ok",
            },
        )
        control_end = await client.wait_turn_end(control.session.id, control.turn_id)
        assert end["turn"]["usage"] == control_end["turn"]["usage"]
        assert end["turn"]["usage"]["output_tokens"] > 0
    finally:
        await second.stop(0)


async def test_a_waiting_turn_whose_worker_lost_its_lease_is_taken_over_and_finds_a_result_sent_meanwhile(
    tmp_path: Path, database_url: str, fake_env: Any, client_for: Any
) -> None:
    from sqlalchemy import select, update

    from services.core.db import open_database
    from services.session.models import TurnRow
    from services.session.store import Store
    from waiting import wait_until

    settings = Settings(data_dir=tmp_path / "data", session_database_url=database_url, turn_lease_s=0.6)
    env_addr = f"127.0.0.1:{fake_env[1].port}"
    a = await start_session_service(settings, address="127.0.0.1:0", environment_addr=env_addr)
    b = await start_session_service(settings, address="127.0.0.1:0", environment_addr=env_addr)
    migrations = Path(str(__import__("services.session.server", fromlist=["x"]).__file__)).parent / "migrations" / "versions"
    db = await open_database(settings.database_url("session"), "session", migrations)
    store = Store(db)
    try:
        client = client_for(a.address)
        agent = {"model": "scripted", "tools": [{"type": "function", "name": "hold", "description": "", "parameters": {}}]}
        created = await client.create_session({"agent": agent, "environment": {"type": "none"}, "input": "call hold\nresumed"})
        session_id = created.session.id
        seen = await client.wait_for(session_id, lambda e: e["type"] == "agent.session.requires_action")
        call_id = seen[-1][1]["session"]["required_actions"][0]["call_id"]
        # As if the worker had died: its lease is over and no longer its own.
        await store.transact(
            lambda u: u.session.execute(
                update(TurnRow).where(TurnRow.id == created.turn_id).values(worker_id="w_gone", lease_expires_at=0.0)
            )
        )
        await client_for(b.address).submit(
            session_id,
            {"type": "agent.session.input.tool_result", "turn_id": created.turn_id, "call_id": call_id, "success": True, "output": "ok"},
        )

        async def taken_over() -> bool:
            worker = await store.query(lambda s: s.scalar(select(TurnRow.worker_id).where(TurnRow.id == created.turn_id)))
            return worker not in ("w_gone", None)

        await wait_until(taken_over, timeout=10, what="another worker to take the waiting turn over")
        end = await client.wait_turn_end(session_id, created.turn_id, timeout=15.0)
        assert end["type"] == "agent.session.turn.completed"
        types = [e["type"] for _, e in await client_for(b.address).events(session_id)]
        assert types.count("agent.session.requires_action") == 1
        assert types.count("agent.session.in_progress") == 2  # the turn's start, and its resumption
        assert types.count("agent.session.turn.completed") == 1
    finally:
        await db.dispose()
        await a.stop(0)
        await b.stop(0)


async def test_a_restarted_service_resumes_the_turn_and_reattaches_to_the_command_still_running(
    tmp_path: Path, fake_env: Any, client_for: Any
) -> None:
    fake: FakeEnvironmentService = fake_env[0]
    settings = Settings(data_dir=tmp_path / "data")
    env_addr = f"127.0.0.1:{fake_env[1].port}"
    first = await start_session_service(settings, address="127.0.0.1:0", environment_addr=env_addr)
    client = client_for(first.address)
    script = "$ echo before; while [ ! -e go ]; do sleep 0.05; done; echo after\n$ echo next"
    created = await client.create_session({"agent": {"model": "scripted"}, "environment": {"type": "openai_hosted"}, "input": script})
    session_id = created.session.id
    await client.wait_for(session_id, lambda e: e["type"] == "agent.output.command_execution_output.delta")
    await first.stop(0)

    second = await start_session_service(settings, address="127.0.0.1:0", environment_addr=env_addr)
    try:
        client = client_for(second.address)
        # The command ran on through the restart; let it finish now.
        (fake.envs[created.session.environment_id].root / "go").touch()
        end = await client.wait_turn_end(session_id, created.turn_id)
        assert end["type"] == "agent.session.turn.completed"
        backlog = await client.events(session_id)
        events = [e for _, e in backlog]
        assert [seq for seq, _ in backlog] == list(range(1, len(backlog) + 1))
        assert len({e["event_id"] for e in events}) == len(events)
        done = [e["item"] for e in events if e["type"] == "agent.session.turn.item.done" and e["item"]["type"] == "command_execution"]
        # The reattached command finished once with its whole output, and the model went on.
        assert [(i["status"], i["exit_code"], i["output"]) for i in done] == [
            ("completed", 0, "before\nafter\n"),
            ("completed", 0, "next\n"),
        ]
        deltas = [e["delta"] for e in events if e["type"] == "agent.output.command_execution_output.delta" and e["item_id"] == done[0]["id"]]
        assert "".join(deltas) == "before\nafter\n"
        assert [e["type"] for e in events].count("agent.session.turn.in_progress") == 1
        again = await client.say(session_id, "$ echo back")
        assert (await client.wait_turn_end(session_id, again))["type"] == "agent.session.turn.completed"
    finally:
        await second.stop(0)


async def test_a_resumed_turn_starts_a_command_the_sandbox_has_no_trace_of(
    tmp_path: Path, fake_env: Any, client_for: Any
) -> None:
    fake: FakeEnvironmentService = fake_env[0]
    settings = Settings(data_dir=tmp_path / "data")
    env_addr = f"127.0.0.1:{fake_env[1].port}"
    first = await start_session_service(settings, address="127.0.0.1:0", environment_addr=env_addr)
    client = client_for(first.address)
    script = "$ echo partial; [ -e once ] || { touch once; sleep 60; }\n$ echo next"
    created = await client.create_session({"agent": {"model": "scripted"}, "environment": {"type": "openai_hosted"}, "input": script})
    session_id = created.session.id
    await client.wait_for(session_id, lambda e: e["type"] == "agent.output.command_execution_output.delta")
    await first.stop(0)
    # As if the previous worker had died before its start reached the sandbox.
    fake.envs[created.session.environment_id].processes.clear()

    second = await start_session_service(settings, address="127.0.0.1:0", environment_addr=env_addr)
    try:
        client = client_for(second.address)
        end = await client.wait_turn_end(session_id, created.turn_id)
        assert end["type"] == "agent.session.turn.completed"
        events = [e for _, e in await client.events(session_id)]
        done = [e["item"] for e in events if e["type"] == "agent.session.turn.item.done" and e["item"]["type"] == "command_execution"]
        assert [(i["status"], i["output"]) for i in done] == [("completed", "partial\n"), ("completed", "next\n")]
    finally:
        await second.stop(0)


async def test_a_turn_whose_worker_lost_its_lease_is_taken_over_by_another_replica_which_reattaches_to_its_command(
    tmp_path: Path, database_url: str, fake_env: Any, client_for: Any
) -> None:
    from sqlalchemy import select, update

    from services.core.db import open_database
    from services.session.models import TurnRow
    from services.session.store import Store
    from waiting import wait_until

    fake: FakeEnvironmentService = fake_env[0]
    # Short leases, so that the takeover comes at once.
    settings = Settings(data_dir=tmp_path / "data", session_database_url=database_url, turn_lease_s=0.6)
    env_addr = f"127.0.0.1:{fake_env[1].port}"
    a = await start_session_service(settings, address="127.0.0.1:0", environment_addr=env_addr)
    b = await start_session_service(settings, address="127.0.0.1:0", environment_addr=env_addr)
    migrations = Path(str(__import__("services.session.server", fromlist=["x"]).__file__)).parent / "migrations" / "versions"
    db = await open_database(settings.database_url("session"), "session", migrations)
    store = Store(db)
    try:
        client = client_for(a.address)
        script = "$ echo before; while [ ! -e go ]; do sleep 0.05; done; echo after\n$ echo next"
        created = await client.create_session({"agent": {"model": "scripted"}, "environment": {"type": "openai_hosted"}, "input": script})
        session_id = created.session.id
        await client.wait_for(session_id, lambda e: e["type"] == "agent.output.command_execution_output.delta")
        # As if the worker had stopped renewing: its lease is over and no longer its own.
        await store.transact(
            lambda u: u.session.execute(
                update(TurnRow).where(TurnRow.id == created.turn_id).values(worker_id="w_gone", lease_expires_at=0.0)
            )
        )

        async def taken_over() -> bool:
            worker = await store.query(lambda s: s.scalar(select(TurnRow.worker_id).where(TurnRow.id == created.turn_id)))
            return worker not in ("w_gone", None)

        await wait_until(taken_over, timeout=10, what="another worker to take the turn over")
        (fake.envs[created.session.environment_id].root / "go").touch()
        end = await client.wait_turn_end(session_id, created.turn_id)
        assert end["type"] == "agent.session.turn.completed"
        backlog = await client_for(b.address).events(session_id)
        events = [e for _, e in backlog]
        assert [seq for seq, _ in backlog] == list(range(1, len(backlog) + 1))
        done = [e["item"] for e in events if e["type"] == "agent.session.turn.item.done"]
        assert len({i["id"] for i in done}) == len(done)
        commands = [(i["status"], i["output"]) for i in done if i["type"] == "command_execution"]
        assert commands == [("completed", "before\nafter\n"), ("completed", "next\n")]
        assert [e["type"] for e in events].count("agent.session.turn.completed") == 1
    finally:
        await db.dispose()
        await a.stop(0)
        await b.stop(0)


@dataclass
class _OldWorker:
    """A turn waiting for a function result, and a TurnWriter of the worker
    that runs it (the test then takes the turn over)."""

    client: Any
    db: Any
    store: Any
    session_id: str
    turn_id: str
    writer: Any


@asynccontextmanager
async def _old_worker(tmp_path: Path, database_url: str, fake_env: Any, client_for: Any) -> AsyncIterator[_OldWorker]:
    from sqlalchemy import select

    from services.core.db import open_database
    from services.session.models import SessionRow, TurnRow
    from services.session.store import Store
    from services.session.turn_writer import TurnWriter

    settings = Settings(data_dir=tmp_path / "data", session_database_url=database_url)
    service = await start_session_service(settings, address="127.0.0.1:0", environment_addr=f"127.0.0.1:{fake_env[1].port}")
    migrations = Path(str(__import__("services.session.server", fromlist=["x"]).__file__)).parent / "migrations" / "versions"
    db = await open_database(settings.database_url("session"), "session", migrations)
    store = Store(db)
    try:
        client = client_for(service.address)
        agent = {"model": "scripted", "tools": [{"type": "function", "name": "hold", "description": "", "parameters": {}}]}
        created = await client.create_session({"agent": agent, "environment": {"type": "none"}, "input": "call hold"})
        await client.wait_for(created.session.id, lambda e: e["type"] == "agent.session.requires_action")
        row = await store.query(lambda s: s.scalar(select(TurnRow).where(TurnRow.id == created.turn_id)))
        config = await store.query(lambda s: s.scalar(select(SessionRow.agent_config_json).where(SessionRow.id == created.session.id)))
        assert row is not None and config is not None
        writer = TurnWriter(
            store, session_id=created.session.id, turn_id=created.turn_id, agent_config_json=config, transcript=[], worker_id=row.worker_id
        )
        yield _OldWorker(client, db, store, created.session.id, created.turn_id, writer)
    finally:
        await db.dispose()
        await service.stop(0)


async def test_an_append_of_the_old_worker_waits_for_a_takeover_in_flight_and_is_then_refused(
    tmp_path: Path, database_url: str, fake_env: Any, client_for: Any
) -> None:
    from sqlalchemy import update

    from services.session.models import TurnRow
    from services.session.turn_writer import TurnTakenOver

    async with _old_worker(tmp_path, database_url, fake_env, client_for) as old:
        async with old.db.transaction() as takeover:
            await takeover.execute(update(TurnRow).where(TurnRow.id == old.turn_id).values(worker_id="w_successor"))
            append = asyncio.create_task(old.writer.emit({"type": "agent.session.turn.output_text.delta", "delta": "late"}))
            # While the takeover is open, the old worker's append waits for it.
            done, _ = await asyncio.wait({append}, timeout=0.5)
            assert not done
        with pytest.raises(TurnTakenOver):
            await asyncio.wait_for(append, 10)
        events = [e for _, e in await old.client.events(old.session_id)]
        assert all(e.get("delta") != "late" for e in events)


async def test_a_result_written_behind_after_a_takeover_fails_the_old_workers_wait_and_every_later_write(
    tmp_path: Path, database_url: str, fake_env: Any, client_for: Any
) -> None:
    from sqlalchemy import select, update

    from services.session.models import ItemRow, TurnRow
    from services.session.turn_writer import TurnTakenOver

    async with _old_worker(tmp_path, database_url, fake_env, client_for) as old:
        async with old.db.transaction() as takeover:
            await takeover.execute(update(TurnRow).where(TurnRow.id == old.turn_id).values(worker_id="w_successor"))
        item = {"type": "message", "role": "assistant", "status": "completed", "content": [{"type": "output_text", "text": "late"}]}
        handle = await old.writer.add_item(item, entries=[{"role": "assistant", "text": "late"}], output=True, done=True, hold=True)
        old.writer.flush_behind()
        async with asyncio.timeout(10):
            with pytest.raises(TurnTakenOver):
                await old.writer.written()
            # Asked again (the turn's ending asks too), it fails again.
            with pytest.raises(TurnTakenOver):
                await old.writer.written()
            with pytest.raises(TurnTakenOver):
                await old.writer.emit({"type": "agent.session.turn.output_text.delta", "delta": "later"})
        stored = await old.store.query(lambda s: s.scalar(select(ItemRow.id).where(ItemRow.id == handle.id)))
        assert stored is None
        events = [e for _, e in await old.client.events(old.session_id)]
        assert all(e.get("delta") != "later" for e in events)
        assert all((e.get("item") or {}).get("id") != handle.id for e in events)
