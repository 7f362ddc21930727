"""The ``openai`` provider against the streaming fake model server
(``tests/fake_model.py``): streamed tool calls and text, reasoning given
back, retries and the turn error code of each kind of failure."""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest
from fake_model import Answer, Drop, Fail, FakeModel, context_overflow

from services.core.settings import ModelRoute, Settings
from services.session.harness.models import ProviderRegistry, route_for
from services.session.harness.models.base import (
    Completed,
    ModelError,
    ModelRequest,
    ReasoningDelta,
    Retrying,
    TextDelta,
    ToolSpec,
    complete,
)
from services.session.harness.models.openai_provider import OpenAIProvider, RetryPolicy, retry_after_s, wire_name
from services.session.server import start_session_service

FAST = RetryPolicy(max_retries=3, base_delay_s=0.01, max_delay_s=5.0)


def _request(*tools: ToolSpec) -> ModelRequest:
    return ModelRequest(model="gpt-test", instructions="Be terse.", transcript=[{"role": "user", "text": "look it up"}], tools=list(tools))


@pytest.fixture
def model() -> Iterator[FakeModel]:
    with FakeModel() as fake:
        yield fake


@pytest.fixture
async def openai_client(tmp_path: Path, model: FakeModel, fake_env: Any, client_for: Any) -> AsyncIterator[Any]:
    settings = Settings(data_dir=tmp_path / "data", model_base_url=model.base_url, model_api_key="sk-test")
    handle = await start_session_service(settings, address="127.0.0.1:0", environment_addr=f"127.0.0.1:{fake_env[1].port}")
    yield client_for(handle.address)
    await handle.stop(0)


async def test_chat_completions_provider_runs_a_streamed_tool_call_then_answers(openai_client: Any, model: FakeModel) -> None:
    model.script = [
        Answer(tool_calls=[("exec_command", '{"command": "echo hi"}')], usage=(11, 7)),
        Answer(text="The command said: hi", usage=(11, 7)),
    ]
    created = await openai_client.create_session(
        {"agent": {"model": "gpt-test", "instructions": "Be terse."}, "environment": {"type": "openai_hosted"}, "input": "say hi"}
    )
    end = await openai_client.wait_turn_end(created.session.id, created.turn_id)
    assert end["type"] == "agent.session.turn.completed", end
    assert end["usage"]["input_tokens"] == 22 and end["usage"]["output_tokens"] == 14
    items = await openai_client.items(created.session.id)
    assert [i["type"] for i in items] == ["message", "command_execution", "message"]
    assert items[1]["command"] == "echo hi"
    assert items[-1]["content"][0]["text"] == "The command said: hi"
    assert items[-1]["phase"] == "final_answer"

    first, second = model.bodies
    assert first["stream"] is True and first["stream_options"] == {"include_usage": True}
    assert first["messages"][0] == {"role": "system", "content": "Be terse."}
    assert first["messages"][1] == {"role": "user", "content": "say hi"}
    assert {t["function"]["name"] for t in first["tools"]} == {
        "exec_command", "read_file", "write_file", "apply_patch", "start_process", "write_stdin", "kill_process"
    }
    # The arguments arrived in three chunks and were put back together.
    assert second["messages"][2]["tool_calls"][0]["function"]["arguments"] == '{"command": "echo hi"}'
    assert second["messages"][3]["role"] == "tool" and second["messages"][3]["tool_call_id"] == "call_0_0"


async def test_a_streamed_answer_yields_text_and_reasoning_deltas_before_it_completes(model: FakeModel) -> None:
    model.script = [Answer(text="hello there", reasoning="let me think", chunk_chars=3)]
    provider = OpenAIProvider(base_url=model.base_url, api_key="sk", retry=FAST)
    events = [e async for e in provider.stream(_request())]
    await provider.close()
    texts = [e.text for e in events if isinstance(e, TextDelta)]
    thoughts = [e.text for e in events if isinstance(e, ReasoningDelta)]
    assert texts == ["hel", "lo ", "the", "re"] and "".join(thoughts) == "let me think"
    assert isinstance(events[-1], Completed) and events[-1].response.text == "hello there"
    assert events[-1].response.reasoning[0].summary == ["let me think"]


async def test_responses_api_provider_gives_reasoning_back_before_the_function_call(model: FakeModel) -> None:
    model.script = [
        Answer(tool_calls=[("lookup", '{"q": "x"}')], reasoning="I should look it up"),
        Answer(text="done via responses", usage=(5, 3)),
    ]
    provider = OpenAIProvider(base_url=model.base_url, api_key="sk", api="responses", retry=FAST)
    request = _request(ToolSpec("lookup", "Look up", {"type": "object"}))
    first = await complete(provider, request)
    assert first.text is None and [(c.name, c.id) for c in first.tool_calls] == [("lookup", "call_0_0")]
    (reasoning,) = first.reasoning
    assert (reasoning.id, reasoning.summary, reasoning.encrypted_content) == ("rs_0", ["I should look it up"], "enc-0")
    request.transcript += [
        reasoning.as_entry(),
        {"role": "assistant", "tool_calls": [first.tool_calls[0].as_entry()]},
        {"role": "tool", "call_id": "call_0_0", "output": "found"},
    ]
    second = await complete(provider, request)
    assert second.text == "done via responses" and second.usage is not None and second.usage.input_tokens == 5
    body = model.bodies[-1]
    assert body["stream"] is True and body["instructions"] == "Be terse."
    assert body["input"][1] == {
        "type": "reasoning",
        "id": "rs_0",
        "summary": [{"type": "summary_text", "text": "I should look it up"}],
        "encrypted_content": "enc-0",
    }
    assert body["input"][2] == {"type": "function_call", "call_id": "call_0_0", "name": "lookup", "arguments": '{"q": "x"}'}
    assert body["input"][3] == {"type": "function_call_output", "call_id": "call_0_0", "output": "found"}
    await provider.close()


@pytest.mark.parametrize(
    ("ending", "error_code", "code"),
    [
        ("failed", "rate_limit_exceeded", "rate_limit_exceeded"),
        ("failed", "some_new_code", "server_error"),
        ("incomplete", "", "max_output_tokens"),
        ("error", "context_length_exceeded", "context_length_exceeded"),
    ],
)
async def test_a_responses_stream_that_ends_in_failure_raises_its_code(
    model: FakeModel, ending: str, error_code: str, code: str
) -> None:
    model.script = [Answer(text="partial", ending=ending, error_code=error_code)]
    provider = OpenAIProvider(base_url=model.base_url, api_key="sk", api="responses", retry=FAST)
    with pytest.raises(ModelError) as failed:
        await complete(provider, _request())
    assert failed.value.code == code
    await provider.close()


async def test_chat_completions_leaves_reasoning_out_of_the_messages_it_sends(model: FakeModel) -> None:
    model.script = [Answer(text="ok")]
    provider = OpenAIProvider(base_url=model.base_url, api_key="sk", retry=FAST)
    request = _request()
    request.transcript += [{"role": "assistant", "reasoning": {"id": None, "summary": ["hm"], "encrypted_content": None}}]
    await complete(provider, request)
    assert [m["role"] for m in model.bodies[0]["messages"]] == ["system", "user"]
    await provider.close()


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_a_rate_limit_a_server_error_and_a_dropped_connection_are_retried(model: FakeModel, api: str) -> None:
    model.script = [Fail(429, code="rate_limit_exceeded"), Fail(500), Drop(), Answer(text="finally")]
    provider = OpenAIProvider(base_url=model.base_url, api_key="sk", api=api, retry=FAST)  # type: ignore[arg-type]
    events = [e async for e in provider.stream(_request())]
    await provider.close()
    retries = [e for e in events if isinstance(e, Retrying)]
    assert [(r.attempt, r.code) for r in retries] == [(1, "rate_limit_exceeded"), (2, "server_error"), (3, "connection_failed")]
    assert isinstance(events[-1], Completed) and events[-1].response.text == "finally"
    assert len(model.requests) == 4


@contextlib.asynccontextmanager
async def _forward_proxy() -> AsyncIterator[tuple[str, list[str]]]:
    """A plain-HTTP forward proxy on 127.0.0.1 (one request per connection):
    records each request line, rewrites it to origin form and pipes the rest."""
    seen: list[str] = []

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        method, target, version = (await reader.readline()).decode().split()
        seen.append(f"{method} {target}")
        url = httpx2.URL(target)
        upstream_reader, upstream = await asyncio.open_connection(url.host, url.port)
        upstream.write(f"{method} {url.raw_path.decode()} {version}\r\n".encode())
        await asyncio.gather(pipe(reader, upstream), pipe(upstream_reader, writer))

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", seen
    finally:
        server.close()


async def test_model_calls_go_through_the_http_proxy_the_environment_configures(
    model: FakeModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    model.script = [Answer(text="via the proxy")]
    async with _forward_proxy() as (proxy_url, seen):
        for name in ("NO_PROXY", "no_proxy"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HTTP_PROXY", proxy_url)
        provider = OpenAIProvider(base_url=model.base_url, api_key="sk", retry=FAST)
        try:
            response = await complete(provider, _request())
        finally:
            await provider.close()
    assert response.text == "via the proxy"
    assert seen == [f"POST {model.base_url}/chat/completions"]


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_a_model_that_stops_streaming_past_the_timeout_fails_the_call_as_a_request_timeout(
    model: FakeModel, api: str
) -> None:
    held = threading.Event()
    model.script = [Answer(text="partial answer", hold=held)]
    provider = OpenAIProvider(base_url=model.base_url, api_key="sk", api=api, timeout_s=0.5, retry=FAST)  # type: ignore[arg-type]
    try:
        with pytest.raises(ModelError) as failed:
            await complete(provider, _request())
    finally:
        held.set()
        await provider.close()
    assert failed.value.code == "request_timeout"


async def test_retry_after_is_waited_at_least_before_the_next_attempt(model: FakeModel) -> None:
    model.script = [Fail(429, headers={"Retry-After": "1"}), Answer(text="ok")]
    provider = OpenAIProvider(base_url=model.base_url, api_key="sk", retry=FAST)
    events = [e async for e in provider.stream(_request())]
    await provider.close()
    (retry,) = [e for e in events if isinstance(e, Retrying)]
    assert retry.delay_s >= 1.0
    first, second = model.requests
    assert second.received_at - first.answered_at >= 1.0


async def test_retries_stop_at_the_bound_with_the_last_errors_code(model: FakeModel) -> None:
    model.default = Fail(503)
    provider = OpenAIProvider(base_url=model.base_url, api_key="sk", retry=RetryPolicy(max_retries=2, base_delay_s=0.01))
    with pytest.raises(ModelError) as error:
        await complete(provider, _request())
    await provider.close()
    assert error.value.code == "server_overloaded" and "retries exhausted" in error.value.message
    assert len(model.requests) == 3


async def test_a_retry_after_longer_than_the_longest_backoff_ends_the_retries(model: FakeModel) -> None:
    model.default = Fail(429, headers={"Retry-After": "120"})
    provider = OpenAIProvider(base_url=model.base_url, api_key="sk", retry=RetryPolicy(max_retries=3, max_delay_s=10))
    with pytest.raises(ModelError) as error:
        await complete(provider, _request())
    await provider.close()
    assert error.value.code == "rate_limit_exceeded"
    assert len(model.requests) == 1


@pytest.mark.parametrize(
    ("reply", "code"),
    [
        (Fail(400, type="invalid_request_error"), "invalid_request"),
        (context_overflow(), "context_length_exceeded"),
        (Fail(400, "maximum context length is 4096 tokens", type="BadRequestError"), "context_length_exceeded"),
        (Fail(401, type="invalid_request_error", code="invalid_api_key"), "authentication_error"),
        (Fail(404, type="invalid_request_error", code="model_not_found"), "resource_not_found"),
        (Fail(429, code="insufficient_quota", type="insufficient_quota"), "usage_limit_exceeded"),
    ],
)
async def test_a_failure_that_is_not_retried_becomes_its_turn_error_code(model: FakeModel, reply: Fail, code: str) -> None:
    model.default = reply
    provider = OpenAIProvider(base_url=model.base_url, api_key="sk", retry=FAST)
    with pytest.raises(ModelError) as error:
        await complete(provider, _request())
    await provider.close()
    assert error.value.code == code
    assert len(model.requests) == 1


def test_retry_after_is_read_in_seconds_milliseconds_or_as_an_http_date() -> None:
    def failure(headers: dict[str, str]) -> openai.RateLimitError:
        response = httpx2.Response(429, headers=headers, request=httpx2.Request("POST", "http://127.0.0.1/v1/x"))
        return openai.RateLimitError("limited", response=response, body=None)

    assert retry_after_s(failure({"Retry-After": "3"})) == 3.0
    assert retry_after_s(failure({"retry-after-ms": "250"})) == 0.25
    later = email.utils.formatdate(time.time() + 30, usegmt=True)
    value = retry_after_s(failure({"Retry-After": later}))
    assert value is not None and 25 <= value <= 31
    assert retry_after_s(failure({})) is None
    policy = RetryPolicy(max_retries=5, base_delay_s=1.0, max_delay_s=8.0)
    assert all(0.5 <= (policy.delay(1, failure({})) or 0) <= 1.0 for _ in range(20))
    assert all(4.0 <= (policy.delay(5, failure({})) or 0) <= 8.0 for _ in range(20))
    assert policy.delay(6, failure({})) is None


def test_model_routes_send_a_model_to_its_endpoint_exact_name_first_then_longest_prefix() -> None:
    routes = [
        ModelRoute(prefix="gpt-", base_url="http://127.0.0.1:1/v1", api="responses"),
        ModelRoute(prefix="gpt-4o", base_url="http://127.0.0.1:2/v1"),
        ModelRoute(model="gpt-4o-mini", base_url="http://127.0.0.1:3/v1"),
    ]
    assert route_for(routes, "gpt-5") is routes[0]
    assert route_for(routes, "gpt-4o-2024") is routes[1]
    assert route_for(routes, "gpt-4o-mini") is routes[2]
    assert route_for(routes, "llama3") is None
    with pytest.raises(ValueError):
        ModelRoute(base_url="http://127.0.0.1:1/v1")


async def test_the_registry_serves_routed_models_from_their_own_endpoints(tmp_path: Path) -> None:
    with FakeModel([Answer(text="from a")]) as a, FakeModel([Answer(text="from b")]) as b:
        settings = Settings(
            data_dir=tmp_path,
            model_routes=[
                ModelRoute(prefix="a-", base_url=a.base_url, api_key="key-a"),
                ModelRoute(model="b-model", base_url=b.base_url, api_key="key-b", api="responses"),
            ],
        )
        registry = ProviderRegistry(settings)
        first = await complete(registry.for_model("a-large"), _request())
        second = await complete(registry.for_model("b-model"), _request())
        await registry.close()
    assert (first.text, second.text) == ("from a", "from b")
    assert (a.paths, a.requests[0].authorization) == (["/v1/chat/completions"], "Bearer key-a")
    assert (b.paths, b.requests[0].authorization) == (["/v1/responses"], "Bearer key-b")


def test_model_routes_are_read_from_the_environment_as_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        "BERTH_MODEL_ROUTES", json.dumps([{"prefix": "claude-", "base_url": "http://127.0.0.1:9/v1", "api_key": "k"}])
    )
    (route,) = Settings().model_routes
    assert (route.prefix, route.api) == ("claude-", "chat")


async def test_mcp_tool_names_are_mapped_to_valid_function_names_and_back(model: FakeModel) -> None:
    wired = wire_name("docs.search")
    assert wired != "docs.search" and all(c.isalnum() or c in "_-" for c in wired)
    model.script = [Answer(tool_calls=[(wired, '{"q": "x"}')]), Answer(text="ok")]
    provider = OpenAIProvider(base_url=model.base_url, api_key="sk", retry=FAST)
    tools = [ToolSpec("docs.search", "Search", {"type": "object"}), ToolSpec("lookup", "Look up", {"type": "object"})]
    request = _request(*tools)
    first = await complete(provider, request)
    assert [c.name for c in first.tool_calls] == ["docs.search"]
    assert {t["function"]["name"] for t in model.bodies[-1]["tools"]} == {wired, "lookup"}
    request.transcript += [
        {"role": "assistant", "tool_calls": [first.tool_calls[0].as_entry()]},
        {"role": "tool", "call_id": "call_0_0", "output": "found"},
    ]
    await complete(provider, request)
    sent = model.bodies[-1]["messages"]
    assert sent[2]["tool_calls"][0]["function"]["name"] == wired
    await provider.close()


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_a_service_tier_and_verbosity_other_than_the_defaults_are_sent_to_the_model(model: FakeModel, api: str) -> None:
    model.script = [Answer(text="ok"), Answer(text="ok")]
    provider = OpenAIProvider(base_url=model.base_url, api_key="sk", api=api, retry=FAST)  # type: ignore[arg-type]
    request = _request()
    await complete(provider, request)
    request.service_tier, request.verbosity = "flex", "low"
    await complete(provider, request)
    await provider.close()
    plain, tuned = model.bodies
    assert "service_tier" not in plain and "verbosity" not in plain and "text" not in plain
    assert tuned["service_tier"] == "flex"
    assert (tuned["verbosity"] if api == "chat" else tuned["text"]["verbosity"]) == "low"
