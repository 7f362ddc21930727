"""Turns end to end through the Session service's gRPC surface, with the
scripted model and a fake Environment service."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import grpc
import pytest
from openai.types.beta import agent_session
from openai.types.beta.agent_session_item import AgentSessionItem
from openai.types.beta.agents.sessions.turn import Turn
from pydantic import TypeAdapter
from session_support import Client, FakeEnvironmentService

from berth.session.v1 import session_pb2, session_service_pb2
from services.core.wire_json import to_wire
from gateway import render

NONE_ENV = {"type": "none"}
HOSTED = {"type": "openai_hosted"}
AGENT = {"model": "scripted"}


def types(events: list[tuple[int, dict[str, Any]]]) -> list[str]:
    return [e["type"] for _, e in events]


async def test_input_on_create_runs_a_turn_to_a_final_answer_with_sdk_valid_events(client: Client) -> None:
    created = await client.create_session({"agent": AGENT, "environment": NONE_ENV, "input": "Hello there"})
    session_id = created.session.id
    assert created.turn_id and created.created_sequence == 1

    end = await client.wait_turn_end(session_id, created.turn_id)
    assert end["type"] == "agent.session.turn.completed"
    events = await client.events(session_id)

    assert [seq for seq, _ in events] == list(range(1, len(events) + 1))
    for _, event in events:
        client.validate(event)
    assert types(events) == [
        "agent.session.created",
        "agent.session.turn.created",
        "agent.session.turn.in_progress",
        "agent.session.in_progress",
        "agent.session.turn.item.added",
        "agent.session.turn.item.added",
        "agent.session.turn.content_part.added",
        "agent.session.turn.output_text.delta",
        "agent.session.turn.output_text.done",
        "agent.session.turn.content_part.done",
        "agent.session.turn.item.done",
        "agent.session.turn.completed",
        "agent.session.idle",
    ]
    done = [e for _, e in events if e["type"] == "agent.session.turn.item.done"][-1]
    assert done["item"]["phase"] == "final_answer" and done["item"]["content"] == [{"type": "output_text", "text": "Hello there"}]
    assert done["output_index"] == 0
    assert events[-1][1]["session"]["status"] == "idle"
    assert len({e["event_id"] for _, e in events}) == len(events)
    completed = events[-2][1]
    assert completed["turn"]["status"] == "completed" and completed["usage"]["total_tokens"] > 0

    session = await client.get_session(session_id)
    assert session.status == session_pb2.SESSION_STATUS_IDLE
    assert session.usage.total_tokens > 0
    TypeAdapter(agent_session.Agent).validate_python(render.session_agent(session.agent))


async def test_scripted_command_streams_output_and_records_a_command_execution_item(client: Client, fake: FakeEnvironmentService) -> None:
    created = await client.create_session({"agent": AGENT, "environment": HOSTED, "input": "$ echo hi\nall good"})
    session_id = created.session.id
    end = await client.wait_turn_end(session_id, created.turn_id)
    assert end["type"] == "agent.session.turn.completed", end

    events = [e for _, e in await client.events(session_id)]
    for event in events:
        client.validate(event)
    kinds = [e["type"] for e in events]
    pending = kinds.index("agent.session.environment.pending")
    assert kinds[pending + 1] == "agent.session.environment.ready"
    deltas = [e["delta"] for e in events if e["type"] == "agent.output.command_execution_output.delta"]
    assert "".join(deltas) == "hi\n"
    command = next(
        e["item"] for e in events if e["type"] == "agent.session.turn.item.done" and e["item"]["type"] == "command_execution"
    )
    assert command["command"] == "echo hi" and command["exit_code"] == 0 and command["status"] == "completed"
    assert command["output"] == "hi\n" and command["duration_ms"] is not None

    items = await client.items(session_id)
    adapter = TypeAdapter(AgentSessionItem)
    for item in items:
        adapter.validate_python(item)
    assert [i["type"] for i in items] == ["message", "command_execution", "message"]
    assert items[-1]["content"][0]["text"] == "all good"
    assert fake.setup_calls == 1


async def test_function_tool_round_trip_waits_for_the_tool_result(client: Client) -> None:
    agent = {
        "model": "scripted",
        "tools": [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": {"type": "object"}}],
    }
    created = await client.create_session(
        {"agent": agent, "environment": NONE_ENV, "input": 'call get_weather {"city": "Paris"}\nIt is sunny.'}
    )
    session_id = created.session.id
    seen = await client.wait_for(session_id, lambda e: e["type"] == "agent.session.requires_action")
    added = next(
        e for _, e in seen if e["type"] == "agent.session.turn.item.added" and e["item"]["type"] == "function_call"
    )
    call = added["item"]
    assert json.loads(call["arguments"]) == {"city": "Paris"} and call["name"] == "get_weather"
    action = seen[-1][1]["session"]["required_actions"][0]
    assert action == {
        "type": "function_call",
        "call_id": call["call_id"],
        "name": "get_weather",
        "arguments": call["arguments"],
        "turn_id": created.turn_id,
    }
    session = await client.get_session(session_id)
    assert session.status == session_pb2.SESSION_STATUS_REQUIRES_ACTION
    turn = await client.stub.GetTurn(
        session_service_pb2.GetTurnRequest(session_id=session_id, turn_id=created.turn_id), metadata=client.md
    )
    assert turn.turn.status == session_pb2.TURN_STATUS_WAITING

    await client.submit(
        session_id,
        {
            "type": "agent.session.input.tool_result",
            "turn_id": created.turn_id,
            "call_id": call["call_id"],
            "success": True,
            "output": '{"temp_c": 21}',
        },
    )
    end = await client.wait_turn_end(session_id, created.turn_id)
    assert end["type"] == "agent.session.turn.completed"
    events = [e for _, e in await client.events(session_id)]
    for event in events:
        client.validate(event)
    output = next(e["item"] for e in events if e["type"] == "agent.session.turn.item.added" and e["item"]["type"] == "function_call_output")
    assert output["call_id"] == call["call_id"] and output["output"] == '{"temp_c": 21}' and output["status"] == "completed"
    assert [i["type"] for i in await client.items(session_id)] == ["message", "function_call", "function_call_output", "message"]
    assert list((await client.get_session(session_id)).required_actions) == []

    with pytest.raises(grpc.aio.AioRpcError) as answered_twice:
        await client.submit(
            session_id,
            {"type": "agent.session.input.tool_result", "turn_id": created.turn_id, "call_id": call["call_id"], "success": True, "output": "x"},
        )
    assert answered_twice.value.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS)


async def test_tool_result_for_a_turn_not_in_the_session_is_not_found(client: Client) -> None:
    # Unknown or another organization's: the same answer as a path ID.
    created = await client.create_session({"agent": AGENT, "environment": NONE_ENV})
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await client.submit(
            created.session.id,
            {"type": "agent.session.input.tool_result", "turn_id": "turn_x", "call_id": "call_nope", "success": True, "output": "x"},
        )
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_user_message_with_the_models_output_text_is_invalid_argument(client: Client) -> None:
    created = await client.create_session({"agent": AGENT, "environment": NONE_ENV})
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await client.submit(
            created.session.id,
            {"type": "agent.session.input.message", "input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]},
        )
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [e["type"] for _, e in await client.events(created.session.id)] == ["agent.session.created"]


async def test_a_failed_tool_result_reaches_the_model_as_an_error(client: Client) -> None:
    agent = {"model": "scripted", "tools": [{"type": "function", "name": "lookup", "description": "", "parameters": {}}]}
    created = await client.create_session({"agent": agent, "environment": NONE_ENV, "input": "call lookup"})
    seen = await client.wait_for(created.session.id, lambda e: e["type"] == "agent.session.requires_action")
    call_id = seen[-1][1]["session"]["required_actions"][0]["call_id"]
    await client.submit(
        created.session.id,
        {"type": "agent.session.input.tool_result", "turn_id": created.turn_id, "call_id": call_id, "success": False, "error": "boom"},
    )
    end = await client.wait_turn_end(created.session.id, created.turn_id)
    assert end["type"] == "agent.session.turn.completed"
    items = await client.items(created.session.id)
    output = next(i for i in items if i["type"] == "function_call_output")
    assert output["status"] == "failed" and output["error"] == "boom" and output["output"] is None


async def test_cancel_during_a_long_command_ends_the_turn_quickly_and_kills_the_process(client: Client, fake: FakeEnvironmentService) -> None:
    created = await client.create_session({"agent": AGENT, "environment": HOSTED, "input": "$ echo started; sleep 60"})
    session_id = created.session.id
    await client.wait_for(session_id, lambda e: e["type"] == "agent.output.command_execution_output.delta")
    await client.submit(session_id, {"type": "agent.session.input.cancel"})
    end = await client.wait_turn_end(session_id, created.turn_id, timeout=2.0)
    assert end["type"] == "agent.session.turn.cancelled" and end["turn"]["status"] == "cancelled"
    # The sandbox side sees the RPC cancelled, kills the process group and reaps it.
    await asyncio.wait_for(fake.exec_cancelled.wait(), 2.0)
    with pytest.raises(ProcessLookupError):
        os.kill(fake.pids[-1], 0)
    events = [e for _, e in await client.events(session_id)]
    for event in events:
        client.validate(event)
    incomplete = next(
        e["item"] for e in events if e["type"] == "agent.session.turn.item.done" and e["item"]["type"] == "command_execution"
    )
    assert incomplete["status"] == "incomplete" and incomplete["output"] == "started\n"
    assert events[-1]["type"] == "agent.session.idle"
    # A cancelled turn publishes nothing.
    artifacts = await client.stub.ListArtifacts(session_service_pb2.ListArtifactsRequest(session_id=session_id), metadata=client.md)
    assert list(artifacts.artifacts) == []


async def test_a_message_sent_during_a_turn_queues_and_runs_next(client: Client) -> None:
    agent = {"model": "scripted", "tools": [{"type": "function", "name": "hold", "description": "", "parameters": {}}]}
    created = await client.create_session({"agent": agent, "environment": NONE_ENV, "input": "call hold\nfirst"})
    session_id = created.session.id
    seen = await client.wait_for(session_id, lambda e: e["type"] == "agent.session.requires_action")
    second = await client.say(session_id, "second")
    turn = await client.stub.GetTurn(session_service_pb2.GetTurnRequest(session_id=session_id, turn_id=second), metadata=client.md)
    assert turn.turn.status == session_pb2.TURN_STATUS_QUEUED
    call_id = seen[-1][1]["session"]["required_actions"][0]["call_id"]
    await client.submit(
        session_id,
        {"type": "agent.session.input.tool_result", "turn_id": created.turn_id, "call_id": call_id, "success": True, "output": "ok"},
    )
    end = await client.wait_turn_end(session_id, second)
    assert end["type"] == "agent.session.turn.completed"
    events = [e for _, e in await client.events(session_id)]
    ends = [(e["type"], e["turn_id"]) for e in events if e["type"].startswith("agent.session.turn.") and e["type"].endswith(("completed", "in_progress"))]
    assert ends == [
        ("agent.session.turn.in_progress", created.turn_id),
        ("agent.session.turn.completed", created.turn_id),
        ("agent.session.turn.in_progress", second),
        ("agent.session.turn.completed", second),
    ]
    texts = [i["content"][0]["text"] for i in await client.items(session_id) if i["type"] == "message" and i["role"] == "assistant"]
    assert texts == ["first", "second"]


async def test_input_to_an_idle_session_with_a_known_environment_starts_its_turn_in_the_same_commit(client: Client) -> None:
    created = await client.create_session({"agent": AGENT, "environment": NONE_ENV, "input": "first"})
    session_id = created.session.id
    await client.wait_for(session_id, lambda e: e["type"] == "agent.session.idle")
    second = await client.say(session_id, "second")
    # The backlog read right after the submit returns already holds the start.
    backlog = [e for _, e in await client.events(session_id)]
    created_at = next(i for i, e in enumerate(backlog) if e.get("turn_id") == second)
    assert [e["type"] for e in backlog[created_at : created_at + 4]] == [
        "agent.session.turn.created",
        "agent.session.turn.in_progress",
        "agent.session.in_progress",
        "agent.session.turn.item.added",
    ]
    end = await client.wait_turn_end(session_id, second)
    assert end["type"] == "agent.session.turn.completed"
    events = await client.events(session_id)
    assert [seq for seq, _ in events] == list(range(1, len(events) + 1))
    texts = [i["content"][0]["text"] for i in await client.items(session_id) if i["type"] == "message" and i["role"] == "assistant"]
    assert texts == ["first", "second"]


async def test_turns_on_a_ready_environment_start_without_asking_the_environment_service(client: Client, fake: FakeEnvironmentService) -> None:
    created = await client.create_session({"agent": AGENT, "environment": HOSTED, "input": "$ echo one"})
    session_id = created.session.id
    first = await client.wait_turn_end(session_id, created.turn_id)
    assert first["type"] == "agent.session.turn.completed"
    lookups = fake.get_calls
    for text in ("$ echo two", "$ echo three"):
        turn_id = await client.say(session_id, text)
        end = await client.wait_turn_end(session_id, turn_id)
        assert end["type"] == "agent.session.turn.completed"
    assert fake.get_calls == lookups
    outputs = [i["output"] for i in await client.items(session_id) if i["type"] == "command_execution"]
    assert outputs == ["one\n", "two\n", "three\n"]


async def test_the_environment_a_session_shows_follows_its_turns_output_listings_without_a_lookup(
    client: Client, fake: FakeEnvironmentService
) -> None:
    created = await client.create_session({"agent": AGENT, "environment": HOSTED, "input": "$ echo one"})
    session_id = created.session.id
    assert (await client.wait_turn_end(session_id, created.turn_id))["type"] == "agent.session.turn.completed"
    environment_id = created.session.environment_id
    lookups = fake.get_calls
    fake.envs[environment_id].env.session_count = 7  # another session attached meanwhile
    for text in ("$ echo two", "$ echo three"):
        turn_id = await client.say(session_id, text)
        assert (await client.wait_turn_end(session_id, turn_id))["type"] == "agent.session.turn.completed"

    shown = [e["session"]["environment"]["session_count"] for _, e in await client.events(session_id) if e["type"] == "agent.session.in_progress"]
    # The second turn started from the first one's listing; the third from the second's.
    assert shown[-2:] == [1, 7]
    assert fake.get_calls == lookups


async def test_an_agent_update_during_a_turn_applies_to_its_next_model_call(client: Client) -> None:
    hold = {"type": "function", "name": "hold", "description": "", "parameters": {}}
    later = {"type": "function", "name": "later", "description": "", "parameters": {}}
    created = await client.create_session(
        {"agent": {"model": "scripted", "tools": [hold]}, "environment": NONE_ENV, "input": "call hold\ncall later\ndone"}
    )
    session_id = created.session.id
    seen = await client.wait_for(session_id, lambda e: e["type"] == "agent.session.requires_action")
    await client.update_session(session_id, {"agent": {"tools": [hold, later]}})
    call_id = seen[-1][1]["session"]["required_actions"][0]["call_id"]
    await client.submit(
        session_id,
        {"type": "agent.session.input.tool_result", "turn_id": created.turn_id, "call_id": call_id, "success": True, "output": "ok"},
    )
    # Without the update, ``later`` would be an unknown tool and the turn would just finish.
    waiting = await client.wait_for(
        session_id,
        lambda e: e["type"] == "agent.session.requires_action" and e["session"]["required_actions"][0]["name"] == "later",
        after=seen[-1][0],
    )
    assert waiting[-1][1]["session"]["required_actions"][0]["turn_id"] == created.turn_id


async def test_cancelling_a_waiting_turn_leaves_queued_turns_to_run(client: Client) -> None:
    agent = {"model": "scripted", "tools": [{"type": "function", "name": "hold", "description": "", "parameters": {}}]}
    created = await client.create_session({"agent": agent, "environment": NONE_ENV, "input": "call hold"})
    session_id = created.session.id
    await client.wait_for(session_id, lambda e: e["type"] == "agent.session.requires_action")
    second = await client.say(session_id, "after the cancel")
    response = await client.submit(session_id, {"type": "agent.session.input.cancel"})
    assert list(response.turn_ids) == [created.turn_id]
    first_end = await client.wait_turn_end(session_id, created.turn_id)
    assert first_end["type"] == "agent.session.turn.cancelled"
    second_end = await client.wait_turn_end(session_id, second)
    assert second_end["type"] == "agent.session.turn.completed"
    items = await client.items(session_id)
    call = next(i for i in items if i["type"] == "function_call")
    assert call["status"] == "incomplete"
    assert list((await client.get_session(session_id)).required_actions) == []


async def test_deleting_a_session_with_a_running_turn_is_session_active(client: Client, fake: FakeEnvironmentService) -> None:
    created = await client.create_session({"agent": AGENT, "environment": HOSTED, "input": "$ sleep 60"})
    session_id = created.session.id
    await client.wait_for(session_id, lambda e: e["type"] == "agent.session.turn.item.added" and e["item"]["type"] == "command_execution")
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await client.stub.DeleteSession(session_service_pb2.DeleteSessionRequest(session_id=session_id), metadata=client.md)
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert ("reason", "SESSION_ACTIVE") in [(k, v) for k, v in _error_info(error.value)]

    await client.submit(session_id, {"type": "agent.session.input.cancel"})
    await client.wait_turn_end(session_id, created.turn_id)
    await client.stub.DeleteSession(session_service_pb2.DeleteSessionRequest(session_id=session_id), metadata=client.md)
    assert fake.detached == [(created.session.environment_id, session_id)]
    with pytest.raises(grpc.aio.AioRpcError) as gone:
        await client.get_session(session_id)
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND


def _error_info(error: grpc.aio.AioRpcError) -> list[tuple[str, str]]:
    from services.core.errors import reason_from_rpc_error

    reason, _ = reason_from_rpc_error(error)
    return [("reason", reason)]


async def test_a_resumed_stream_misses_nothing(client: Client) -> None:
    created = await client.create_session({"agent": AGENT, "environment": NONE_ENV, "input": "one"})
    session_id = created.session.id
    await client.wait_turn_end(session_id, created.turn_id)
    first = await client.events(session_id)
    cut = first[4][0]
    second_turn = await client.say(session_id, "two")
    await client.wait_turn_end(session_id, second_turn)
    everything = await client.events(session_id)
    resumed = await client.events(session_id, after=cut)
    assert resumed == everything[cut:]
    assert [s for s, _ in resumed] == list(range(cut + 1, len(everything) + 1))
    last_id = everything[-1][1]["event_id"]
    followed = await client.wait_for(session_id, lambda e: e["event_id"] == last_id, after=cut)
    assert followed == everything[cut:]


async def test_a_following_stream_sends_keepalives_when_idle(client: Client) -> None:
    created = await client.create_session({"agent": AGENT, "environment": NONE_ENV})
    call = client.stub.StreamSessionEvents(
        session_service_pb2.StreamSessionEventsRequest(session_id=created.session.id, follow=True, keepalive_ms=50),
        metadata=client.md,
    )
    kinds = []
    async for m in call:
        kinds.append(m.WhichOneof("message"))
        if kinds.count("keepalive_ms") == 2:
            break
    call.cancel()
    assert kinds[0] == "batch" and kinds.count("keepalive_ms") == 2


async def test_turns_are_listed_and_render_as_sdk_turns(client: Client) -> None:
    created = await client.create_session({"agent": AGENT, "environment": NONE_ENV, "input": "a"})
    session_id = created.session.id
    await client.wait_turn_end(session_id, created.turn_id)
    second = await client.say(session_id, "b")
    await client.wait_turn_end(session_id, second)
    response = await client.stub.ListTurns(
        session_service_pb2.ListTurnsRequest(session_id=session_id, page=session_service_pb2.PageRequest(limit=1)),
        metadata=client.md,
    )
    assert [t.id for t in response.turns] == [second] and response.has_more
    turn = Turn.model_validate(to_wire(response.turns[0]))
    assert turn.status == "completed" and turn.completed_at is not None and turn.subagent_id is None
    older = await client.stub.ListTurns(
        session_service_pb2.ListTurnsRequest(session_id=session_id, page=session_service_pb2.PageRequest(limit=1, after=second)),
        metadata=client.md,
    )
    assert [t.id for t in older.turns] == [created.turn_id] and not older.has_more


async def test_scripted_file_writes_and_reads_go_through_the_environment(client: Client, fake: FakeEnvironmentService) -> None:
    script = "write notes/a.md\n```\n# Title\n```\nread notes/a.md\nread missing.txt"
    created = await client.create_session({"agent": AGENT, "environment": HOSTED, "input": script})
    end = await client.wait_turn_end(created.session.id, created.turn_id)
    assert end["type"] == "agent.session.turn.completed"
    assert (fake.envs[created.session.environment_id].root / "notes" / "a.md").read_text() == "# Title\n"
    commands = [i for i in await client.items(created.session.id) if i["type"] == "command_execution"]
    assert [c["command"] for c in commands] == ["write_file notes/a.md", "read_file notes/a.md", "read_file missing.txt"]
    assert commands[1]["output"] == "# Title\n" and commands[1]["status"] == "completed"
    assert commands[2]["status"] == "failed" and commands[2]["output"].startswith("error:")


async def test_a_call_to_an_unconfigured_mcp_server_fails_as_an_mcp_call_item(client: Client) -> None:
    created = await client.create_session({"agent": AGENT, "environment": NONE_ENV, "input": 'mcp docs.search {"q": "x"}'})
    end = await client.wait_turn_end(created.session.id, created.turn_id)
    assert end["type"] == "agent.session.turn.completed"
    events = [e for _, e in await client.events(created.session.id)]
    for event in events:
        client.validate(event)
    call = next(e["item"] for e in events if e["type"] == "agent.session.turn.item.done" and e["item"]["type"] == "mcp_call")
    assert call["server_label"] == "docs" and call["name"] == "search" and call["arguments"] == {"q": "x"}
    assert call["status"] == "failed" and isinstance(call["error"], str) and call["output"] is None


async def test_environment_tools_are_offered_only_with_an_environment(client: Client) -> None:
    created = await client.create_session({"agent": AGENT, "environment": NONE_ENV, "input": "$ echo hi"})
    end = await client.wait_turn_end(created.session.id, created.turn_id)
    assert end["type"] == "agent.session.turn.completed"
    command = next(i for i in await client.items(created.session.id) if i["type"] == "command_execution")
    assert command["status"] == "failed" and "no environment" in command["output"]
