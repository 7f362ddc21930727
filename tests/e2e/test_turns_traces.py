"""Root-turn traces end to end: ``sessions.traces.list`` through the official
SDK with strict validation returns the SDK's ``SessionTrace`` with OTLP
JSON spans for the turn's model calls (tokens), tool calls and waits; the
same trace reaches an OTLP/HTTP collector on 127.0.0.1; another
organization's session is a 404."""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import openai
import pytest
from e2e_stack import Stack, start_stack
from fake_model import Answer, FakeModel
from turns_support import NO_ENVIRONMENT, message, new_turn, session_status, strict_client, submit, turn_status
from waiting import wait_until

LOOKUP: Any = {
    "type": "function",
    "name": "lookup",
    "description": "Looks a value up.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
}


class Collector:
    """An OTLP/HTTP receiver: records the JSON bodies POSTed to /v1/traces."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the stdlib's naming
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length))
                if self.path == "/v1/traces" and self.headers.get("Content-Type", "").startswith("application/json"):
                    collector.bodies.append(body)
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    def __enter__(self) -> Collector:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def model() -> Iterator[FakeModel]:
    with FakeModel() as fake:
        yield fake


@pytest.fixture
def collector() -> Iterator[Collector]:
    with Collector() as c:
        yield c


@pytest.fixture
async def stack(tmp_path: Path, model: FakeModel, collector: Collector) -> AsyncIterator[Stack]:
    stack, stop = await start_stack(
        tmp_path / "berth", model_base_url=model.base_url, model_api_key="x", trace_otlp_endpoint=collector.url
    )
    try:
        yield stack
    finally:
        await stop()  # type: ignore[misc]


def _attributes(span: dict[str, Any]) -> dict[str, Any]:
    return {a["key"]: next(iter(a["value"].values())) for a in span["attributes"]}


def _spans(otlp: dict[str, Any]) -> list[dict[str, Any]]:
    (resource,) = otlp["resourceSpans"]
    (scope,) = resource["scopeSpans"]
    return list(scope["spans"])


async def _turn_with_a_function_call(stack: Stack, model: FakeModel) -> tuple[str, str]:
    """A completed root turn: a model call that calls ``lookup``, a wait for
    its result, and a second model call that answers."""
    model.script = [
        Answer(tool_calls=[("lookup", json.dumps({"key": "k"}))], usage=(11, 7)),
        Answer(text="The value is 3.", usage=(23, 5)),
    ]
    client = strict_client(stack)
    session = await client.beta.agents.sessions.create(
        agent={"model": "some-model", "tools": [LOOKUP]}, environment=NO_ENVIRONMENT, input="Look k up."
    )
    turn_id = await new_turn(client, session.id, [])
    (action,) = (await session_status(client, session.id, "requires_action")).required_actions
    result = {
        "type": "agent.session.input.tool_result",
        "turn_id": turn_id,
        "call_id": action.call_id,  # type: ignore[union-attr]
        "success": True,
        "output": "3",
    }
    await submit(client, session.id, result)
    assert (await turn_status(client, session.id, turn_id, ("completed", "failed"))).status == "completed"
    return session.id, turn_id


async def test_a_root_turn_records_a_trace_of_its_model_calls_tool_calls_and_waits(stack: Stack, model: FakeModel) -> None:
    session_id, turn_id = await _turn_with_a_function_call(stack, model)
    client = strict_client(stack)

    # Stored with the turn's outcome: listed as soon as the turn is completed.
    (trace,) = [t async for t in client.beta.agents.sessions.traces.list(session_id)]
    assert (trace.id, trace.object, trace.session_id) == (turn_id, "agent.session.trace", session_id)
    turn = await client.beta.agents.sessions.turns.retrieve(turn_id, session_id=session_id)
    assert trace.created_at == turn.created_at

    spans = _spans(trace.otlp)
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        by_kind.setdefault(_attributes(span)["berth.span_kind"], []).append(span)
    (root,) = by_kind["turn"]
    assert _attributes(root)["berth.turn_id"] == turn_id and "parentSpanId" not in root
    assert {s["traceId"] for s in spans} == {root["traceId"]} and len(root["traceId"]) == 32
    assert all(s["parentSpanId"] == root["spanId"] for s in spans if s is not root)
    assert all(int(s["endTimeUnixNano"]) >= int(s["startTimeUnixNano"]) > 0 for s in spans)

    models = [_attributes(s) for s in by_kind["model"]]
    assert [(m["gen_ai.request.model"], m["gen_ai.usage.input_tokens"], m["gen_ai.usage.output_tokens"]) for m in models] == [
        ("some-model", "11", "7"),
        ("some-model", "23", "5"),
    ]
    (tool,) = by_kind["tool"]
    assert _attributes(tool)["gen_ai.tool.name"] == "lookup"
    (wait,) = by_kind["wait"]
    assert _attributes(wait)["berth.wait_for"] == "function_results"
    # The wait lies between the two model calls.
    first, second = by_kind["model"]
    assert int(first["endTimeUnixNano"]) <= int(wait["startTimeUnixNano"]) <= int(second["startTimeUnixNano"])
    assert root["status"] == {"code": 1}


async def test_a_trace_is_exported_to_the_configured_otlp_collector(
    stack: Stack, model: FakeModel, collector: Collector
) -> None:
    _, turn_id = await _turn_with_a_function_call(stack, model)

    def exported() -> dict[str, Any] | None:
        for body in collector.bodies:
            for span in _spans(body):
                if _attributes(span).get("berth.turn_id") == turn_id:
                    return body
        return None

    body = await wait_until(exported, 30, what="the trace at the collector")
    (resource,) = body["resourceSpans"]
    assert {"key": "service.name", "value": {"stringValue": "berth"}} in resource["resource"]["attributes"]
    assert len(_spans(body)) == 5


async def test_another_organizations_session_traces_are_not_found(stack: Stack, model: FakeModel) -> None:
    session_id, _ = await _turn_with_a_function_call(stack, model)
    other = openai.AsyncOpenAI(
        base_url=stack.base_url, api_key=await stack.new_key("org-b"), max_retries=0, _strict_response_validation=True
    )
    with pytest.raises(openai.NotFoundError) as missing:
        await other.beta.agents.sessions.traces.list(session_id)
    assert missing.value.status_code == 404 and missing.value.code == "not_found"


async def test_a_subagents_turns_are_spans_of_the_root_turn_that_created_it(stack: Stack) -> None:
    client = strict_client(stack)
    script = "subagent a: subagent b: deep answer\\nsubagent wait\\nmiddle answer\nsubagent wait\nall done"
    session = await client.beta.agents.sessions.create(
        agent={"model": "scripted", "multi_agent": {"enabled": True}}, environment=NO_ENVIRONMENT, input=script
    )
    turn_id = await new_turn(client, session.id, [])
    assert (await turn_status(client, session.id, turn_id, ("completed", "failed"))).status == "completed"
    subagents = {s.name or "": s.id async for s in client.beta.agents.sessions.subagents.list(session.id)}
    child_turns = {
        name: [t.id async for t in client.beta.agents.sessions.subagents.turns.list(sid, session_id=session.id)]
        for name, sid in subagents.items()
    }
    assert sorted(child_turns) == ["a", "b"] and all(len(ids) == 1 for ids in child_turns.values())

    # One trace, the root turn's: the subagents' turns are in it, not traces of their own.
    (trace,) = [t async for t in client.beta.agents.sessions.traces.list(session.id)]
    assert trace.id == turn_id
    spans = _spans(trace.otlp)
    by_id = {s["spanId"]: s for s in spans}
    assert len({s["traceId"] for s in spans}) == 1
    runs = {_attributes(s)["berth.turn_id"]: s for s in spans if _attributes(s)["berth.span_kind"] == "subagent"}
    assert sorted(runs) == sorted([child_turns["a"][0], child_turns["b"][0]])

    def creator(run: dict[str, Any]) -> dict[str, Any]:
        return by_id[run["parentSpanId"]]

    # Each subagent's turn hangs off the create_subagent call that started it:
    # a's off the root turn's, b's off a's.
    a_run, b_run = runs[child_turns["a"][0]], runs[child_turns["b"][0]]
    assert _attributes(creator(a_run))["gen_ai.tool.name"] == "create_subagent"
    assert _attributes(by_id[creator(a_run)["parentSpanId"]])["berth.span_kind"] == "turn"
    assert _attributes(creator(b_run))["gen_ai.tool.name"] == "create_subagent"
    assert by_id[creator(b_run)["parentSpanId"]] is a_run
    # The subagents' model calls are in the root turn's trace, under their runs.
    models_under = {
        name: [s for s in spans if s.get("parentSpanId") == runs[ids[0]]["spanId"] and _attributes(s)["berth.span_kind"] == "model"]
        for name, ids in child_turns.items()
    }
    assert all(models_under[name] for name in ("a", "b")), models_under


def _padded_otlp(size: int) -> str:
    """An OTLP JSON document of about ``size`` bytes: one span with a long name."""
    span = {"traceId": "0" * 32, "spanId": "0" * 16, "name": "x" * size, "kind": 1}
    return json.dumps({"resourceSpans": [{"resource": {"attributes": []}, "scopeSpans": [{"scope": {"name": "pad"}, "spans": [span]}]}]})


async def test_a_page_of_traces_holds_fewer_to_fit_16_mib_and_a_trace_that_cannot_fit_alone_is_trace_too_large(
    stack: Stack, model: FakeModel
) -> None:
    model.script = [Answer(text="one", usage=(3, 1)), Answer(text="two", usage=(3, 1))]
    client = strict_client(stack)
    sessions = client.beta.agents.sessions
    session = await sessions.create(agent={"model": "some-model"}, environment=NO_ENVIRONMENT, input="first")
    first = await new_turn(client, session.id, [])
    await turn_status(client, session.id, first, "completed")
    await submit(client, session.id, message("second"))
    second = await new_turn(client, session.id, [first])
    await turn_status(client, session.id, second, "completed")
    # Control: both small traces fit on one page.
    page = await sessions.traces.list(session.id, order="asc")
    assert ([t.id for t in page.data], page.has_more) == ([first, second], False)

    # Two traces of 9 MiB: one a page, and the cursor reaches the other.
    mib = 1024 * 1024
    with sqlite3.connect(stack.data_dir / "session.db") as db:
        db.execute("UPDATE traces SET otlp_json = ? WHERE session_id = ?", (_padded_otlp(9 * mib), session.id))
    page = await sessions.traces.list(session.id, order="asc")
    assert ([t.id for t in page.data], page.has_more) == ([first], True)
    assert [t.id async for t in sessions.traces.list(session.id, order="asc")] == [first, second]

    # One of 17 MiB: the page before it ends early, and the page it leads is refused.
    with sqlite3.connect(stack.data_dir / "session.db") as db:
        db.execute("UPDATE traces SET otlp_json = ? WHERE id = ?", (_padded_otlp(17 * mib), second))
    page = await sessions.traces.list(session.id, order="asc")
    assert ([t.id for t in page.data], page.has_more) == ([first], True)
    with pytest.raises(openai.BadRequestError) as refused:
        await sessions.traces.list(session.id, order="asc", after=first)
    assert (refused.value.status_code, refused.value.code) == (400, "trace_too_large")
