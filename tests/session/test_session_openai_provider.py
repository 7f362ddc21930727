"""The ``openai`` provider against a tiny OpenAI-compatible server (stdlib
http.server in a thread) that answers with a tool call, then with text."""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from services.core.settings import Settings
from services.session.harness.models.base import ModelError, ModelRequest
from services.session.harness.models.openai_provider import OpenAIProvider
from services.session.server import start_session_service


class FakeModelServer:
    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.fail_with: int | None = None
        self.chat_call = ("exec_command", '{"command": "echo hi"}')
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append((self.path, body))
                if server.fail_with is not None:
                    self._send(server.fail_with, {"error": {"message": "nope", "type": "invalid_request_error", "code": None}})
                    return
                if self.path.endswith("/chat/completions"):
                    self._send(200, server.chat(body))
                else:
                    self._send(200, server.responses(body))

            def _send(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                return None

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        answered = any(m["role"] == "tool" for m in body["messages"])
        message: dict[str, Any]
        if answered:
            tool_output = next(m["content"] for m in body["messages"] if m["role"] == "tool")
            message = {"role": "assistant", "content": f"The command said: {tool_output.splitlines()[-1]}"}
            finish = "stop"
        else:
            message = {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_m1", "type": "function", "function": {"name": self.chat_call[0], "arguments": self.chat_call[1]}}
                ],
            }
            finish = "tool_calls"
        return {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1,
            "model": body["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18, "prompt_tokens_details": {"cached_tokens": 2}},
        }

    def responses(self, body: dict[str, Any]) -> dict[str, Any]:
        answered = any(i.get("type") == "function_call_output" for i in body["input"])
        if answered:
            output: list[dict[str, Any]] = [
                {
                    "type": "message",
                    "id": "msg_1",
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": "done via responses", "annotations": []}],
                }
            ]
        else:
            output = [
                {
                    "type": "function_call",
                    "id": "fc_1",
                    "call_id": "call_r1",
                    "name": "lookup",
                    "arguments": '{"q": "x"}',
                    "status": "completed",
                }
            ]
        return {
            "id": "resp_1",
            "object": "response",
            "created_at": 1,
            "model": body["model"],
            "status": "completed",
            "output": output,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "usage": {
                "input_tokens": 5,
                "output_tokens": 3,
                "total_tokens": 8,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 1},
            },
        }


@pytest.fixture
def model_server() -> Iterator[FakeModelServer]:
    server = FakeModelServer()
    server.thread.start()
    yield server
    server.httpd.shutdown()
    server.httpd.server_close()


@pytest.fixture
async def openai_client(tmp_path: Path, model_server: FakeModelServer, fake_env: Any, client_for: Any) -> AsyncIterator[Any]:
    settings = Settings(data_dir=tmp_path / "data", model_base_url=model_server.base_url, model_api_key="sk-test")
    handle = await start_session_service(settings, address="127.0.0.1:0", environment_addr=f"127.0.0.1:{fake_env[1].port}")
    yield client_for(handle.address)
    await handle.stop(0)


async def test_chat_completions_provider_runs_a_tool_call_then_answers(openai_client: Any, model_server: FakeModelServer) -> None:
    created = await openai_client.create_session(
        {"agent": {"model": "gpt-test", "instructions": "Be terse."}, "environment": {"type": "openai_hosted"}, "input": "say hi"}
    )
    end = await openai_client.wait_turn_end(created.session.id, created.turn_id)
    assert end["type"] == "agent.session.turn.completed", end
    assert end["usage"] == {
        "input_tokens": 22,
        "input_tokens_details": {"cached_tokens": 4},
        "output_tokens": 14,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 36,
    }
    items = await openai_client.items(created.session.id)
    assert [i["type"] for i in items] == ["message", "command_execution", "message"]
    assert items[-1]["content"][0]["text"] == "The command said: hi"

    first, second = (body for _, body in model_server.requests)
    assert first["model"] == "gpt-test"
    assert first["messages"][0] == {"role": "system", "content": "Be terse."}
    assert first["messages"][1] == {"role": "user", "content": "say hi"}
    assert {t["function"]["name"] for t in first["tools"]} == {
        "exec_command", "read_file", "write_file", "apply_patch", "start_process", "write_stdin", "kill_process"
    }
    assert second["messages"][2]["tool_calls"][0]["id"] == "call_m1"
    assert second["messages"][3]["role"] == "tool" and second["messages"][3]["tool_call_id"] == "call_m1"


async def test_responses_api_provider_maps_function_calls_and_usage(model_server: FakeModelServer) -> None:
    provider = OpenAIProvider(base_url=model_server.base_url, api_key="sk", api="responses")
    from services.session.harness.models.base import ToolSpec

    request = ModelRequest(
        model="gpt-test",
        instructions="Be terse.",
        transcript=[{"role": "user", "text": "look it up"}],
        tools=[ToolSpec("lookup", "Look up", {"type": "object"})],
    )
    first = await provider.complete(request)
    assert first.text is None and first.tool_calls[0].name == "lookup" and first.tool_calls[0].id == "call_r1"
    request.transcript += [
        {"role": "assistant", "tool_calls": [first.tool_calls[0].as_entry()]},
        {"role": "tool", "call_id": "call_r1", "output": "found"},
    ]
    second = await provider.complete(request)
    assert second.text == "done via responses" and second.usage is not None and second.usage.reasoning_tokens == 1
    body = model_server.requests[-1][1]
    assert body["instructions"] == "Be terse."
    assert body["input"][1] == {"type": "function_call", "call_id": "call_r1", "name": "lookup", "arguments": '{"q": "x"}'}
    assert body["input"][2] == {"type": "function_call_output", "call_id": "call_r1", "output": "found"}
    await provider.close()


async def test_a_model_error_becomes_a_session_turn_error_code(model_server: FakeModelServer) -> None:
    model_server.fail_with = 400
    provider = OpenAIProvider(base_url=model_server.base_url, api_key="sk")
    with pytest.raises(ModelError) as error:
        await provider.complete(ModelRequest(model="m", instructions=None, transcript=[{"role": "user", "text": "x"}], tools=[]))
    assert error.value.code == "invalid_request"
    await provider.close()


async def test_mcp_tool_names_are_mapped_to_valid_function_names_and_back(model_server: FakeModelServer) -> None:
    from services.session.harness.models.base import ToolSpec
    from services.session.harness.models.openai_provider import wire_name

    wired = wire_name("docs.search")
    assert wired != "docs.search" and all(c.isalnum() or c in "_-" for c in wired)
    model_server.chat_call = (wired, '{"q": "x"}')
    provider = OpenAIProvider(base_url=model_server.base_url, api_key="sk")
    tools = [ToolSpec("docs.search", "Search", {"type": "object"}), ToolSpec("lookup", "Look up", {"type": "object"})]
    request = ModelRequest(model="gpt-test", instructions=None, transcript=[{"role": "user", "text": "find"}], tools=tools)
    first = await provider.complete(request)
    assert [c.name for c in first.tool_calls] == ["docs.search"]
    assert {t["function"]["name"] for t in model_server.requests[-1][1]["tools"]} == {wired, "lookup"}
    request.transcript += [
        {"role": "assistant", "tool_calls": [first.tool_calls[0].as_entry()]},
        {"role": "tool", "call_id": "call_m1", "output": "found"},
    ]
    await provider.complete(request)
    sent = model_server.requests[-1][1]["messages"]
    assert sent[1]["tool_calls"][0]["function"]["name"] == wired
    await provider.close()
