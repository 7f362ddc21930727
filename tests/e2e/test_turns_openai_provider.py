"""The ``openai`` model provider end to end: a stack whose model base URL is
the streaming fake model server (``tests/fake_model.py``), driven through
the official SDK with strict parsing: streamed text and reasoning, tool
calls run concurrently, retries that the stream announces, and the turn
error code of each kind of model failure."""

from __future__ import annotations

import asyncio
import datetime
import json
import re
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_stack import Stack, start_stack
from fake_model import Answer, Drop, Fail, FakeModel, context_overflow
from turns_support import EVENT_CLASSES, HOSTED, strict_client

COMMAND = 'echo report > "$REBYTE_OUTPUT_DIR/model.txt"; echo from-model'


@pytest.fixture
def model() -> Iterator[FakeModel]:
    with FakeModel() as fake:
        yield fake


async def _stack(tmp_path: Path, model: FakeModel, **overrides: object) -> AsyncIterator[Stack]:
    stack, stop = await start_stack(
        tmp_path / "berth", model_base_url=model.base_url, model_api_key="x", model_retry_base_delay_s=0.01, **overrides
    )
    try:
        yield stack
    finally:
        await stop()  # type: ignore[misc]


@pytest.fixture
async def model_stack(tmp_path: Path, bwrap_available: None, model: FakeModel) -> AsyncIterator[Stack]:
    async for stack in _stack(tmp_path, model):
        yield stack


@pytest.fixture
async def responses_stack(tmp_path: Path, bwrap_available: None, model: FakeModel) -> AsyncIterator[Stack]:
    async for stack in _stack(tmp_path, model, model_api="responses"):
        yield stack


async def _events(stack: Stack, input: str, environment: dict[str, Any] | None = None) -> list[Any]:
    client = strict_client(stack)
    env: Any = environment or {"type": "none"}
    async with asyncio.timeout(90):
        stream = await client.beta.agents.sessions.create(
            agent={"model": "some-model", "instructions": "Be brief."},
            environment=env,
            input=input,
            stream=True,
        )
        events = [event async for event in stream]
    for event in events:
        assert type(event) is EVENT_CLASSES[event.type]
    return events


async def test_a_turn_on_an_openai_compatible_model_runs_its_tool_call_and_answers(model_stack: Stack, model: FakeModel) -> None:
    model.script = [
        Answer(tool_calls=[("exec_command", json.dumps({"command": COMMAND}))], usage=(11, 7)),
        Answer(text="The command printed from-model.", usage=(23, 5)),
    ]
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

    assert model.paths == ["/v1/chat/completions"] * 2
    assert [r.authorization for r in model.requests] == ["Bearer x"] * 2
    first, second = model.bodies
    assert first["model"] == second["model"] == "some-model"
    tools: dict[str, Any] = {t["function"]["name"]: t for t in first["tools"]}
    assert {"exec_command", "read_file", "write_file"} <= set(tools)
    assert first["messages"][0] == {"role": "system", "content": "Be brief."}
    assert first["messages"][-1] == {"role": "user", "content": "Write the report."}
    assert second["messages"][: len(first["messages"])] == first["messages"]
    assistant, tool = second["messages"][len(first["messages"]) :]
    assert json.loads(assistant["tool_calls"][0]["function"]["arguments"]) == {"command": COMMAND}
    assert (tool["role"], tool["tool_call_id"]) == ("tool", assistant["tool_calls"][0]["id"])
    assert "from-model" in tool["content"]

    usage = result.turn.usage
    assert usage is not None and (usage.input_tokens, usage.output_tokens) == (34, 12)
    session = await client.beta.agents.sessions.retrieve(result.session_id)
    assert session.usage is not None and session.usage.total_tokens == 46


async def test_text_deltas_reach_the_sse_stream_while_the_model_is_still_answering(model_stack: Stack, model: FakeModel) -> None:
    hold = threading.Event()
    model.script = [Answer(text="streamed word by word", chunk_chars=5, hold=hold)]
    client = strict_client(model_stack)
    seen: list[Any] = []
    try:
        async with asyncio.timeout(60):
            stream = await client.beta.agents.sessions.create(
                agent={"model": "some-model"}, environment={"type": "none"}, input="go", stream=True
            )
            async for event in stream:
                seen.append(event)
                if event.type == "agent.session.turn.output_text.delta" and not hold.is_set():
                    # The model has sent one chunk and waits: the delta came before its end.
                    assert event.delta == "strea"
                    assert not any(e.type == "agent.session.turn.completed" for e in seen)
                    hold.set()
    finally:
        hold.set()
    kinds = [e.type for e in seen]
    deltas = [e.delta for e in seen if e.type == "agent.session.turn.output_text.delta"]
    assert "".join(deltas) == "streamed word by word" and len(deltas) == 5
    added = next(e for e in seen if e.type == "agent.session.turn.item.added" and e.item.type == "message" and e.item.role == "assistant")
    assert added.item.status == "in_progress" and added.item.phase is None
    done = next(e for e in seen if e.type == "agent.session.turn.item.done" and e.item.type == "message")
    assert done.item.phase == "final_answer" and done.item.content[0].text == "streamed word by word"
    assert kinds.index("agent.session.turn.content_part.added") < kinds.index("agent.session.turn.output_text.delta")
    assert kinds.index("agent.session.turn.output_text.done") < kinds.index("agent.session.turn.completed")


async def test_reasoning_becomes_a_reasoning_item_with_summary_events(model_stack: Stack, model: FakeModel) -> None:
    model.script = [Answer(text="42", reasoning="Think of the question first.", chunk_chars=8)]
    events = await _events(model_stack, "what is the answer?")
    kinds = [e.type for e in events]
    reasoning = [e for e in events if e.type.startswith("agent.session.turn.reasoning_summary")]
    assert [e.type for e in reasoning] == [
        "agent.session.turn.reasoning_summary_part.added",
        *["agent.session.turn.reasoning_summary_text.delta"] * 4,
        "agent.session.turn.reasoning_summary_text.done",
        "agent.session.turn.reasoning_summary_part.done",
    ]
    assert "".join(e.delta for e in reasoning if e.type.endswith("text.delta")) == "Think of the question first."
    added = next(e for e in events if e.type == "agent.session.turn.item.added" and e.item.type == "reasoning")
    done = next(e for e in events if e.type == "agent.session.turn.item.done" and e.item.type == "reasoning")
    assert {e.item_id for e in reasoning} == {added.item.id}
    assert [s.text for s in done.item.summary] == ["Think of the question first."]
    message = next(e for e in events if e.type == "agent.session.turn.item.added" and e.item.type == "message" and e.item.role == "assistant")
    assert added.output_index < message.output_index
    assert kinds.index("agent.session.turn.reasoning_summary_part.done") < kinds.index("agent.session.turn.output_text.delta")

    client = strict_client(model_stack)
    session_id = events[0].session.id
    items = [i async for i in client.beta.agents.sessions.items.list(session_id)]
    assert [i.type for i in items] == ["message", "reasoning", "message"]
    assert [s.text for s in items[1].summary] == ["Think of the question first."]  # type: ignore[union-attr]


async def test_responses_api_reasoning_is_streamed_and_given_back_with_the_tool_call(responses_stack: Stack, model: FakeModel) -> None:
    model.script = [
        Answer(reasoning="Run the command.", tool_calls=[("exec_command", json.dumps({"command": "echo ok"}))]),
        Answer(text="it printed ok"),
    ]
    events = await _events(responses_stack, "run it", environment=HOSTED)
    assert events[-2].type == "agent.session.turn.completed"
    assert any(e.type == "agent.session.turn.reasoning_summary_text.delta" for e in events)
    assert model.paths == ["/v1/responses"] * 2
    given_back = model.bodies[1]["input"]
    kinds = [i.get("type", "message") for i in given_back]
    assert kinds == ["message", "reasoning", "function_call", "function_call_output"]
    assert given_back[1]["id"] == "rs_0" and given_back[1]["encrypted_content"] == "enc-0"


async def test_the_tool_calls_of_one_response_run_concurrently_and_keep_the_models_order(model_stack: Stack, model: FakeModel) -> None:
    # Each command waits for the other's file: run one after the other, the
    # first would give up (exit 7) long before the second started.
    def rendezvous(mine: str, theirs: str) -> str:
        return (
            f"touch /workspace/{mine}; i=0; while [ ! -e /workspace/{theirs} ]; do sleep 0.05; i=$((i+1)); "
            f"[ $i -gt 200 ] && exit 7; done; echo {mine}-met"
        )

    model.script = [
        Answer(
            tool_calls=[
                ("exec_command", json.dumps({"command": rendezvous("a", "b")})),
                ("exec_command", json.dumps({"command": rendezvous("b", "c")})),
                ("exec_command", json.dumps({"command": rendezvous("c", "a")})),
            ]
        ),
        Answer(text="all met"),
    ]
    events = await _events(model_stack, "meet", environment=HOSTED)
    assert events[-2].type == "agent.session.turn.completed"
    added = [e for e in events if e.type == "agent.session.turn.item.added" and e.item.type == "command_execution"]
    done = [e for e in events if e.type == "agent.session.turn.item.done" and e.item.type == "command_execution"]
    assert [e.item.command for e in added] == [rendezvous("a", "b"), rendezvous("b", "c"), rendezvous("c", "a")]
    assert [e.output_index for e in added] == sorted(e.output_index for e in added)
    assert {e.item.id: (e.item.exit_code, e.item.output) for e in done} == {
        added[0].item.id: (0, "a-met\n"),
        added[1].item.id: (0, "b-met\n"),
        added[2].item.id: (0, "c-met\n"),
    }
    for event in events:
        if event.type == "agent.output.command_execution_output.delta":
            owner = next(e for e in added if e.item.id == event.item_id)
            assert event.output_index == owner.output_index
    # The results go back to the model in the calls' order.
    sent = model.bodies[1]["messages"]
    calls = [c["id"] for m in sent if m["role"] == "assistant" for c in m.get("tool_calls") or ()]
    results = [m["tool_call_id"] for m in sent if m["role"] == "tool"]
    assert calls == results == ["call_0_0", "call_0_1", "call_0_2"]


async def test_a_rate_limited_model_call_is_retried_after_retry_after_and_the_stream_says_so(
    model_stack: Stack, model: FakeModel
) -> None:
    model.script = [Fail(429, code="rate_limit_exceeded", headers={"Retry-After": "1"}), Fail(500), Drop(), Answer(text="ok")]
    events = await _events(model_stack, "hello")
    assert [e.type for e in events][-2:] == ["agent.session.turn.completed", "agent.session.idle"]
    waits = [e for e in events if e.type == "error"]
    assert [(e.error.type, e.error.code) for e in waits] == [
        ("model_retrying", "rate_limit_exceeded"),
        ("model_retrying", "server_error"),
        ("model_retrying", "connection_failed"),
    ]
    first, second = model.requests[:2]
    assert second.received_at - first.answered_at >= 1.0
    assert len(model.requests) == 4


@pytest.mark.parametrize(
    ("reply", "code"),
    [
        (Fail(400, type="invalid_request_error"), "invalid_request"),
        (context_overflow(), "context_length_exceeded"),
        (Fail(401, type="invalid_request_error", code="invalid_api_key"), "authentication_error"),
    ],
)
async def test_a_failing_model_call_fails_the_turn_with_its_code(model_stack: Stack, model: FakeModel, reply: Fail, code: str) -> None:
    model.default = reply
    events = await _events(model_stack, "hello")
    kinds = [e.type for e in events]
    assert kinds[-3:] == ["error", "agent.session.turn.failed", "agent.session.idle"]
    failed = events[-2].turn
    assert (failed.status, failed.error.code) == ("failed", code)
    assert model.paths == ["/v1/chat/completions"]


async def test_a_model_that_keeps_failing_fails_the_turn_once_the_retries_are_used_up(
    tmp_path: Path, bwrap_available: None, model: FakeModel
) -> None:
    model.default = Fail(502)
    async for stack in _stack(tmp_path, model, model_max_retries=2):
        events = await _events(stack, "hello")
    retrying = [e for e in events if e.type == "error" and e.error.type == "model_retrying"]
    assert len(retrying) == 2
    failed = events[-2].turn
    assert (failed.status, failed.error.code) == ("failed", "server_error")
    assert len(model.requests) == 3


async def test_time_awareness_tells_the_model_the_current_time_on_every_call(model_stack: Stack, model: FakeModel) -> None:
    model.script = [Answer(tool_calls=[("exec_command", json.dumps({"command": "true"}))]), Answer(text="noted")]
    client = strict_client(model_stack)
    before = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    async with asyncio.timeout(60):
        stream = await client.beta.agents.sessions.create(
            agent={"model": "some-model", "instructions": "Be brief.", "experimental": {"time_awareness": True}},
            environment=HOSTED,
            input="what time is it?",
            stream=True,
        )
        result = await stream.get_final_result()
    after = datetime.datetime.now(datetime.UTC)
    assert result.output_text == "noted"
    for body in model.bodies:
        system = body["messages"][0]
        assert system["role"] == "system" and system["content"].startswith("Be brief.\n\n")
        match = re.search(r"The current date and time is (\S+) \(UTC\)\.", system["content"])
        assert match is not None
        told = datetime.datetime.fromisoformat(match.group(1).replace("Z", "+00:00"))
        assert before <= told <= after
