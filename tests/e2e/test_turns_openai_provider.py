"""The ``openai`` model provider end to end: a stack whose model base URL is
a tiny OpenAI-compatible server started by the test, driven through the
official SDK. The fake answers first with an ``exec_command`` tool call,
then with text, and records what it was sent."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_stack import Stack, start_stack
from turns_support import HOSTED, FakeChatModel, strict_client

COMMAND = 'echo report > "$REBYTE_OUTPUT_DIR/model.txt"; echo from-model'
USAGE = [(11, 7), (23, 5)]


@pytest.fixture
def model() -> Iterator[FakeChatModel]:
    call = {"id": "call_fake_1", "type": "function", "function": {"name": "exec_command", "arguments": json.dumps({"command": COMMAND})}}
    with FakeChatModel(
        [{"content": None, "tool_calls": [call]}, {"content": "The command printed from-model."}], usage=USAGE
    ) as fake:
        yield fake


@pytest.fixture
async def model_stack(tmp_path: Path, bwrap_available: None, model: FakeChatModel) -> AsyncIterator[Stack]:
    stack, stop = await start_stack(tmp_path / "berth", model_base_url=model.base_url, model_api_key="x")
    try:
        yield stack
    finally:
        await stop()  # type: ignore[misc]


async def test_a_turn_on_an_openai_compatible_model_runs_its_tool_call_and_answers(
    model_stack: Stack, model: FakeChatModel
) -> None:
    client = strict_client(model_stack)
    async with asyncio.timeout(60):
        stream = await client.beta.agents.sessions.create(
            agent={"model": "some-model", "instructions": "Be brief."},
            environment=HOSTED,
            input="Write the report.",
            stream=True,
        )
        result = await stream.get_final_result()

    assert result.output_text == "The command printed from-model."
    items = [i async for i in client.beta.agents.sessions.turns.items.list(result.turn_id, session_id=result.session_id)]
    assert [i.type for i in items] == ["message", "command_execution", "message"]
    command = items[1]
    assert (command.command, command.status, command.exit_code, command.output) == (  # type: ignore[union-attr]
        COMMAND,
        "completed",
        0,
        "from-model\n",
    )
    (artifact,) = [a async for a in client.beta.agents.sessions.artifacts.list(result.session_id)]
    assert artifact.path == "/workspace/outputs/model.txt"

    # What the model server saw: the tool definitions, then the tool's result.
    assert model.paths == ["/v1/chat/completions"] * 2
    assert model.authorization == ["Bearer x"] * 2
    first, second = model.requests
    assert first["model"] == second["model"] == "some-model"
    tools: dict[str, Any] = {t["function"]["name"]: t for t in first["tools"]}
    assert {"exec_command", "read_file", "write_file"} <= set(tools)
    assert tools["exec_command"]["type"] == "function"
    assert tools["exec_command"]["function"]["parameters"]["required"] == ["command"]
    assert first["messages"][0] == {"role": "system", "content": "Be brief."}
    assert first["messages"][-1] == {"role": "user", "content": "Write the report."}
    assert second["messages"][: len(first["messages"])] == first["messages"]
    assistant, tool = second["messages"][len(first["messages"]) :]
    assert [c["id"] for c in assistant["tool_calls"]] == ["call_fake_1"]
    assert json.loads(assistant["tool_calls"][0]["function"]["arguments"]) == {"command": COMMAND}
    assert (tool["role"], tool["tool_call_id"]) == ("tool", "call_fake_1")
    assert "from-model" in tool["content"]

    # Token usage reported by the model is summed onto the turn and the session.
    input_tokens, output_tokens = sum(u[0] for u in USAGE), sum(u[1] for u in USAGE)
    for usage in (result.turn.usage, (await client.beta.agents.sessions.turns.retrieve(result.turn_id, session_id=result.session_id)).usage):
        assert usage is not None
        assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (
            input_tokens,
            output_tokens,
            input_tokens + output_tokens,
        )
    session = await client.beta.agents.sessions.retrieve(result.session_id)
    assert session.usage is not None and session.usage.total_tokens == input_tokens + output_tokens
    assert session.agent.model == "some-model"


async def test_a_failing_model_server_fails_the_turn_with_a_turn_error_code(model_stack: Stack, model: FakeChatModel) -> None:
    model.replies.clear()  # every request now gets a 400
    client = strict_client(model_stack)
    async with asyncio.timeout(60):
        stream = await client.beta.agents.sessions.create(
            agent={"model": "some-model"}, environment={"type": "none"}, input="hello", stream=True
        )
        events = [event async for event in stream]

    kinds = [e.type for e in events]
    assert kinds[-3:] == ["error", "agent.session.turn.failed", "agent.session.idle"]
    failed = events[-2].turn  # type: ignore[union-attr]
    assert (failed.status, failed.error.code) == ("failed", "invalid_request")  # type: ignore[union-attr]
    assert model.paths == ["/v1/chat/completions"]
