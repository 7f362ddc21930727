from __future__ import annotations

import asyncio
import json
from typing import Any

import openai

from gateway_support import FakeSession, Stack


def turn(session_id: str, turn_id: str, status: str) -> dict[str, Any]:
    return {
        "id": turn_id,
        "object": "agent.session.turn",
        "session_id": session_id,
        "agent_id": "agent_1",
        "created_at": 1,
        "status": status,
        "subagent_id": None,
    }


def with_events(stack: Stack, count: int) -> FakeSession:
    fake = stack.session.add_session(stack.org_id)
    stack.session.append(fake, "agent.session.created")
    for _ in range(count - 1):
        stack.session.append(fake, "agent.session.in_progress")
    return fake


def frames(body: str) -> list[dict[str, str]]:
    """SSE frames as dicts of their fields; comment lines are dropped."""
    out = []
    for block in body.split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.split("\n"):
            if line and not line.startswith(":"):
                name, _, value = line.partition(": ")
                fields[name] = value
        if fields:
            out.append(fields)
    return out


def sdk(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{stack.base_url}/v1", api_key=stack.key, max_retries=0, _strict_response_validation=True
    )


async def test_event_stream_frames_each_event_with_sequence_type_and_json(stack: Stack) -> None:
    fake = with_events(stack, 3)
    async with stack.client() as client:
        response = await client.get(f"/v1/agents/sessions/{fake.session.id}/events", headers={"Last-Event-ID": "0"})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    got = frames(response.text)
    assert [f["id"] for f in got] == ["1", "2", "3"]
    assert [f["event"] for f in got] == ["agent.session.created", "agent.session.in_progress", "agent.session.in_progress"]
    assert [json.loads(f["data"])["event_id"] for f in got] == ["evt_1", "evt_2", "evt_3"]


async def test_a_batch_from_the_service_becomes_one_frame_per_event_in_order(stack: Stack) -> None:
    stack.session.batch_events = True
    fake = with_events(stack, 4)
    async with stack.client() as client:
        response = await client.get(f"/v1/agents/sessions/{fake.session.id}/events", headers={"Last-Event-ID": "1"})
    assert response.status_code == 200
    got = frames(response.text)
    assert [f["id"] for f in got] == ["2", "3", "4"]
    assert [json.loads(f["data"])["event_id"] for f in got] == ["evt_2", "evt_3", "evt_4"]


async def test_last_event_id_resumes_after_that_sequence(stack: Stack) -> None:
    fake = with_events(stack, 4)
    async with stack.client() as client:
        response = await client.get(f"/v1/agents/sessions/{fake.session.id}/events", headers={"Last-Event-ID": "2"})
    assert [f["id"] for f in frames(response.text)] == ["3", "4"]
    assert stack.session.last("StreamSessionEvents").after_sequence == 2


async def test_malformed_last_event_id_is_400(stack: Stack) -> None:
    fake = with_events(stack, 1)
    async with stack.client() as client:
        response = await client.get(f"/v1/agents/sessions/{fake.session.id}/events", headers={"Last-Event-ID": "abc"})
    assert (response.status_code, response.json()["error"]["param"]) == (400, "Last-Event-ID")


async def test_service_keepalive_becomes_one_comment_line_without_blank_line(stack: Stack) -> None:
    fake = with_events(stack, 2)
    stack.session.keepalive_between_events = True
    stack.settings.sse_keepalive_s = 0.0001
    async with stack.client() as client:
        response = await client.get(f"/v1/agents/sessions/{fake.session.id}/events")
    assert ": ping\nid: 2\n" in response.text
    assert ": ping\n\n" not in response.text


async def test_gateway_sends_keepalives_while_the_stream_is_idle(stack: Stack) -> None:
    fake = with_events(stack, 1)
    stack.settings.sse_keepalive_s = 0.05
    stack.session.hold_stream = asyncio.Event()
    seen = ""
    async with stack.client() as client, client.stream("GET", f"/v1/agents/sessions/{fake.session.id}/events") as response:
        async for chunk in response.aiter_text():
            seen += chunk
            if ": ping\n" in seen:
                break
    assert seen.startswith("id: 1\n")


async def test_headers_arrive_before_any_event_and_disconnect_cancels_only_the_grpc_stream(stack: Stack) -> None:
    fake = stack.session.add_session(stack.org_id)
    stack.session.hold_stream = asyncio.Event()
    async with stack.client() as client:
        async with client.stream("GET", f"/v1/agents/sessions/{fake.session.id}/events") as response:
            assert response.status_code == 200
            await asyncio.wait_for(stack.session.stream_waiting.wait(), timeout=5)
        await asyncio.wait_for(stack.session.stream_cancelled.wait(), timeout=5)
    assert stack.session.count("SubmitSessionEvents") == 0
    assert fake.session.id in stack.session.sessions


async def test_event_stream_of_an_unknown_session_is_404(stack: Stack) -> None:
    async with stack.client() as client:
        response = await client.get("/v1/agents/sessions/sess_0000000000000000000000000/events")
    assert (response.status_code, response.json()["error"]["code"]) == (404, "not_found")


def _initial_turn_script(turn_id: str) -> list[tuple[str, dict[str, Any]]]:
    return [
        ("agent.session.idle", {}),  # an idle before the turn must not end the stream
        ("agent.session.in_progress", {}),
        ("agent.session.turn.created", {"turn_id": turn_id, "turn": turn("x", turn_id, "in_progress")}),
        ("agent.session.turn.completed", {"turn_id": turn_id, "turn": turn("x", turn_id, "completed")}),
        ("agent.session.idle", {}),
        ("agent.session.in_progress", {}),  # a later turn: not part of the creation stream
    ]


async def test_streaming_creation_ends_after_the_idle_that_follows_the_initial_turn(stack: Stack) -> None:
    stack.session.creation_script = _initial_turn_script("turn_first")
    stack.session.hold_stream = asyncio.Event()  # the service would keep following
    body = {"environment": {"type": "none"}, "agent": {"model": "m"}, "input": "hi", "stream": True}
    async with stack.client() as client:
        response = await client.post("/v1/agents/sessions", json=body)
    types = [f["event"] for f in frames(response.text)]
    assert types == [
        "agent.session.created",
        "agent.session.idle",
        "agent.session.in_progress",
        "agent.session.turn.created",
        "agent.session.turn.completed",
        "agent.session.idle",
    ]
    # Streaming is the gateway's concern: the contract has no field for it.
    forwarded = stack.session.last("CreateSession")
    assert [f.name for f in forwarded.DESCRIPTOR.fields if "stream" in f.name] == []
    assert forwarded.input[0].content[0].text == "hi"


async def test_streaming_creation_ends_at_the_boundary_inside_a_batch(stack: Stack) -> None:
    stack.session.creation_script = _initial_turn_script("turn_first")
    stack.session.batch_events = True
    stack.session.hold_stream = asyncio.Event()
    body = {"environment": {"type": "none"}, "agent": {"model": "m"}, "input": "hi", "stream": True}
    async with stack.client() as client:
        response = await client.post("/v1/agents/sessions", json=body)
    types = [f["event"] for f in frames(response.text)]
    # The later turn's event shares the batch but lies past the boundary.
    assert types[-2:] == ["agent.session.turn.completed", "agent.session.idle"]
    assert "agent.session.in_progress" not in types[types.index("agent.session.turn.created") :]


async def test_sdk_streaming_creation_yields_parsed_events_and_stops_when_the_server_closes(stack: Stack) -> None:
    stack.session.creation_script = _initial_turn_script("turn_first")
    stack.session.hold_stream = asyncio.Event()
    client = sdk(stack)
    stream = await client.beta.agents.sessions.create(
        environment={"type": "none"}, agent={"model": "m"}, input="hi", stream=True
    )
    types = [event.type async for event in stream]
    await client.close()
    assert types[0] == "agent.session.created" and types[-1] == "agent.session.idle"


async def test_sdk_reads_an_event_stream_with_ids_and_keepalives(stack: Stack) -> None:
    fake = with_events(stack, 3)
    stack.session.keepalive_between_events = True
    client = sdk(stack)
    stream = await client.beta.agents.sessions.events.stream(fake.session.id)
    ids = [event.event_id async for event in stream]
    await client.close()
    assert ids == ["evt_1", "evt_2", "evt_3"]


def test_obfuscation_pads_an_event_with_hex_characters_and_keeps_every_member() -> None:
    from gateway.sse import obfuscated

    payloads: list[dict[str, Any]] = [
        {"type": "agent.session.idle"},
        {"type": "x", "text": 'quote " and \\ and \u00e9', "nested": {"a": [1, 2, {"b": None}]}},
        {"type": "y" * 31},
    ]
    for payload in payloads:
        plain = json.dumps(payload, separators=(",", ":"))
        lengths = set()
        for _ in range(40):
            decoded = json.loads(obfuscated(payload))
            padding = decoded.pop("obfuscation")
            assert decoded == payload
            assert all(c in "0123456789abcdef" for c in padding)
            base = (-len(plain)) % 32
            assert base <= len(padding) < base + 32
            lengths.add(len(padding))
        assert len(lengths) > 1
