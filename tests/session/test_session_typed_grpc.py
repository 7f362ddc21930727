"""An internal client drives a whole session over gRPC with the typed
contract alone, as the design card says internal clients do: it creates an
environment and a session that references it, submits input, follows the
event stream until the turn ends and lists the items. It reads and builds
protobuf messages only; no public wire JSON is parsed or produced."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from google.protobuf import field_mask_pb2
from grpc_support import internal_channel
from session_support import Client

from berth.environment.v1 import environment_pb2, environment_service_pb2, environment_service_pb2_grpc
from berth.session.v1 import session_pb2, session_service_pb2
from services.core.grpc_server import RunningServer

_TURN_END = frozenset({"turn_completed", "turn_failed", "turn_cancelled"})


@pytest.fixture
async def environments(
    fake_env: tuple[Any, RunningServer],
) -> AsyncIterator[environment_service_pb2_grpc.EnvironmentServiceStub]:
    channel = internal_channel(f"127.0.0.1:{fake_env[1].port}")
    yield environment_service_pb2_grpc.EnvironmentServiceStub(channel)
    await channel.close()


def _user_message(text: str) -> session_service_pb2.InputEvent:
    part = session_pb2.ContentPart(type="input_text", input_text=session_pb2.InputText(text=text))
    message = session_service_pb2.InputMessage(role="user", content=[part])
    return session_service_pb2.InputEvent(
        type="agent.session.input.message", message=session_service_pb2.InputMessageEvent(input=[message])
    )


async def _create_session_on(client: Client, environment_id: str) -> session_pb2.Session:
    request = session_service_pb2.CreateSessionRequest(
        agent=session_pb2.AgentConfig(model="scripted"),
        agent_mask=field_mask_pb2.FieldMask(paths=["model"]),
        environment=session_service_pb2.SessionEnvironment(environment_id=environment_id),
    )
    created = await client.stub.CreateSession(request, metadata=client.md)
    session: session_pb2.Session = created.session
    return session


async def _follow_until_turn_ends(client: Client, session_id: str, turn_id: str) -> list[session_pb2.SessionEvent]:
    seen: list[session_pb2.SessionEvent] = []
    call = client.stub.StreamSessionEvents(
        session_service_pb2.StreamSessionEventsRequest(session_id=session_id, after_sequence=0, follow=True),
        metadata=client.md,
    )

    async def read() -> None:
        async for message in call:
            for event in message.batch.events:
                seen.append(event)
                kind = event.WhichOneof("payload")
                if kind in _TURN_END and getattr(event, kind).turn_id == turn_id:
                    return

    try:
        await asyncio.wait_for(read(), 30)
    finally:
        call.cancel()
    return seen


async def test_an_internal_client_runs_a_turn_on_a_referenced_environment_with_typed_messages(
    client: Client, environments: environment_service_pb2_grpc.EnvironmentServiceStub
) -> None:
    env = await environments.CreateEnvironment(
        environment_service_pb2.CreateEnvironmentRequest(config=environment_pb2.EnvironmentConfig()), metadata=client.md
    )
    session = await _create_session_on(client, env.environment.id)
    assert session.environment_kind == session_pb2.ENVIRONMENT_KIND_HOSTED
    assert session.environment_id == env.environment.id

    submitted = await client.stub.SubmitSessionEvents(
        session_service_pb2.SubmitSessionEventsRequest(session_id=session.id, events=[_user_message("$ echo typed\ndone")]),
        metadata=client.md,
    )
    (turn_id,) = submitted.turn_ids

    events = await _follow_until_turn_ends(client, session.id, turn_id)
    assert [e.sequence for e in events] == list(range(1, len(events) + 1))
    assert all(e.event_id.startswith("evt_") for e in events)
    kinds = [e.WhichOneof("payload") for e in events]
    assert kinds[0] == "session_created" and kinds[-1] == "turn_completed", kinds
    assert events[0].session_created.session.id == session.id
    assert events[0].session_created.session.environment_id == env.environment.id
    assert {"turn_created", "turn_in_progress", "item_added", "item_done"} <= set(kinds)
    ended = events[-1].turn_completed
    assert ended.turn.id == turn_id and ended.turn.status == session_pb2.TURN_STATUS_COMPLETED
    assert ended.turn.HasField("completed_at") and not ended.turn.HasField("subagent_id")
    assert ended.usage.total_tokens == ended.usage.input_tokens + ended.usage.output_tokens > 0
    added = [e.item_added.item for e in events if e.WhichOneof("payload") == "item_added"]
    assert [i.WhichOneof("item") for i in added][0] == "message"

    listed = await client.stub.ListItems(
        session_service_pb2.ListItemsRequest(
            session_id=session.id, turn_id=turn_id, page=session_service_pb2.PageRequest(order="asc")
        ),
        metadata=client.md,
    )
    items = list(listed.items)
    assert [i.WhichOneof("item") for i in items] == ["message", "command_execution", "message"]
    user, command, answer = items
    assert user.message.role == "user" and user.message.content[0].input_text.text == "$ echo typed\ndone"
    assert command.command_execution.status == "completed" and command.command_execution.exit_code == 0
    assert command.command_execution.output == "typed\n"
    assert answer.message.role == "assistant" and answer.message.content[0].WhichOneof("part") == "output_text"
    assert all(i.turn_id == turn_id and i.session_id == session.id for i in items)

    turn = await client.stub.GetTurn(
        session_service_pb2.GetTurnRequest(session_id=session.id, turn_id=turn_id), metadata=client.md
    )
    assert turn.turn == ended.turn
