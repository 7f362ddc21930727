"""Application function tools end to end: the turn waits in
``requires_action`` until a tool result is posted, answered by hand through
``events.create`` or automatically by the SDK's ``tool_handlers=``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from e2e_stack import Stack
from e2e_support import api_error, inline_session
from turns_support import (
    NO_ENVIRONMENT,
    new_turn,
    session_status,
    strict_client,
    submit,
    turn_status,
)

WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
AGENT: Any = {"model": "scripted", "tools": [WEATHER]}
SCRIPT = 'call get_weather {"city": "Paris"}\nforecast delivered'


async def test_a_function_call_waits_in_requires_action_until_its_tool_result_is_posted(stack: Stack) -> None:
    client = strict_client(stack)
    session = await client.beta.agents.sessions.create(agent=AGENT, environment=NO_ENVIRONMENT, input=SCRIPT)
    turn_id = await new_turn(client, session.id, [])

    waiting = await session_status(client, session.id, "requires_action")
    (action,) = waiting.required_actions
    assert action.type == "function_call"
    assert (action.name, action.turn_id) == ("get_weather", turn_id)  # type: ignore[union-attr]
    arguments = action.arguments  # type: ignore[union-attr]
    assert (json.loads(arguments) if isinstance(arguments, str) else arguments) == {"city": "Paris"}
    assert (await client.beta.agents.sessions.turns.retrieve(turn_id, session_id=session.id)).status == "waiting"

    result = {
        "type": "agent.session.input.tool_result",
        "turn_id": turn_id,
        "call_id": action.call_id,  # type: ignore[union-attr]
        "success": True,
        "output": '{"temp_c": 21}',
    }
    await submit(client, session.id, result)
    turn = await turn_status(client, session.id, turn_id, ("completed", "failed", "cancelled"))
    assert turn.status == "completed"

    items = [i async for i in client.beta.agents.sessions.turns.items.list(turn_id, session_id=session.id, order="asc")]
    assert [(i.type, getattr(i, "role", None)) for i in items] == [
        ("message", "user"),
        ("function_call", None),
        ("function_call_output", None),
        ("message", "assistant"),
    ]
    call, output, answer = items[1], items[2], items[3]
    assert (call.call_id, call.name, call.status) == (action.call_id, "get_weather", "completed")  # type: ignore[union-attr]
    assert (output.call_id, output.output, output.status) == (action.call_id, '{"temp_c": 21}', "completed")  # type: ignore[union-attr]
    assert answer.content[0].text == "forecast delivered"  # type: ignore[union-attr]
    after = await client.beta.agents.sessions.retrieve(session.id)
    assert (after.status, after.required_actions) == ("idle", [])

    # The call was answered once; a second answer is refused.
    again = await api_error(client.beta.agents.sessions.events.create(session.id, events=[result]))  # type: ignore[list-item]
    assert (again.status_code, again.code) == (409, "conflict")


async def test_a_tool_result_for_an_unknown_call_is_rejected_without_touching_the_turn(stack: Stack) -> None:
    client = strict_client(stack)
    session = await client.beta.agents.sessions.create(agent=AGENT, environment=NO_ENVIRONMENT, input=SCRIPT)
    turn_id = await new_turn(client, session.id, [])
    await session_status(client, session.id, "requires_action")

    wrong = {"type": "agent.session.input.tool_result", "turn_id": turn_id, "call_id": "call_unknown", "success": True}
    rejected = await api_error(client.beta.agents.sessions.events.create(session.id, events=[wrong]))  # type: ignore[list-item]
    # The code and message the SDK's dispatcher recognises (and retries) as "not registered yet".
    assert (rejected.status_code, rejected.code) == (400, "invalid_request_error")
    assert rejected.body["message"] == "Unknown pending tool call: call_unknown"  # type: ignore[index]
    assert (await client.beta.agents.sessions.turns.retrieve(turn_id, session_id=session.id)).status == "waiting"
    await submit(client, session.id, {"type": "agent.session.input.cancel"})
    assert (await turn_status(client, session.id, turn_id, ("completed", "cancelled"))).status == "cancelled"


async def test_the_sdk_tool_handler_answers_the_call_during_a_streamed_creation(stack: Stack) -> None:
    client = strict_client(stack)
    received: list[dict[str, Any]] = []

    async def get_weather(arguments: dict[str, Any]) -> dict[str, Any]:
        received.append(arguments)
        return {"temp_c": 21}

    async with asyncio.timeout(60):
        stream = await client.beta.agents.sessions.create(
            agent=AGENT, environment=NO_ENVIRONMENT, input=SCRIPT, stream=True, tool_handlers={"get_weather": get_weather}
        )
        result = await stream.get_final_result()

    assert received == [{"city": "Paris"}]
    assert (result.output_text, result.turn.status) == ("forecast delivered", "completed")
    items = [i async for i in client.beta.agents.sessions.items.list(result.session_id, order="asc")]
    (output,) = [i for i in items if i.type == "function_call_output"]
    assert json.loads(output.output) == {"temp_c": 21}  # type: ignore[union-attr, arg-type]


async def test_the_sessions_stream_helper_dispatches_tool_handlers_on_an_idle_session(stack: Stack) -> None:
    client = strict_client(stack)
    session = await inline_session(client)
    session = await client.beta.agents.sessions.update(session.id, agent={"model": "scripted", "tools": [WEATHER]})
    assert [t.name for t in session.agent.tools] == ["get_weather"]  # type: ignore[union-attr]

    def get_weather(arguments: dict[str, Any]) -> str:
        return f"sunny in {arguments['city']}"

    async with asyncio.timeout(60):
        async with client.beta.agents.sessions.stream(
            session.id, input=SCRIPT, tool_handlers={"get_weather": get_weather}
        ) as turn:
            result = await turn.get_final_result()

    assert result.output_text == "forecast delivered"
    items = [i async for i in client.beta.agents.sessions.turns.items.list(result.turn_id, session_id=session.id)]
    (output,) = [i for i in items if i.type == "function_call_output"]
    assert output.output == "sunny in Paris"  # type: ignore[union-attr]
