"""A fake OpenAI-compatible model server on 127.0.0.1 that streams the way
OpenAI does, for tests and benchmarks.

It serves ``POST /v1/chat/completions`` and ``POST /v1/responses``, both
streamed as server-sent events whose payloads are built from the openai
SDK's own types (``ChatCompletionChunk``, Responses stream events), so what
it sends parses under the SDK's models. Each request takes the next entry of
``script``:

- ``Answer``: text, tool calls and reasoning, split into chunks (a tool
  call's arguments are split across chunks, as OpenAI does); ``hold`` keeps
  the stream open after the first text chunk until the event is set.
- ``Fail``: an HTTP error status with an OpenAI error body and headers
  (e.g. ``Retry-After``).
- ``Drop``: the connection is closed without an answer.

Once the script is used up, ``respond`` (a function of the request body)
answers when set, else ``default`` (a ``Fail`` 400 unless set).
Every request is recorded with the monotonic time it arrived and the time
its answer was fully written.

By default each streamed answer closes its connection. ``keep_alive=True``
sends it chunked and keeps the connection for the next request, with
``TCP_NODELAY`` (as OpenAI's servers do), so a client's next call reuses it;
benchmarks use that to measure their own work, not connection set-up.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast

from openai.types.chat import ChatCompletionChunk
from openai.types.chat.chat_completion_chunk import (
    Choice,
    ChoiceDelta,
    ChoiceDeltaToolCall,
    ChoiceDeltaToolCallFunction,
)
from openai.types.completion_usage import CompletionUsage
from openai.types.responses import (
    Response,
    ResponseCompletedEvent,
    ResponseCreatedEvent,
    ResponseError,
    ResponseErrorEvent,
    ResponseFailedEvent,
    ResponseFunctionToolCall,
    ResponseIncompleteEvent,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseReasoningItem,
    ResponseReasoningSummaryPartAddedEvent,
    ResponseReasoningSummaryPartDoneEvent,
    ResponseReasoningSummaryTextDeltaEvent,
    ResponseReasoningSummaryTextDoneEvent,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
    ResponseUsage,
)
from openai.types.responses.response import IncompleteDetails
from openai.types.responses.response_reasoning_item import Summary
from openai.types.responses.response_reasoning_summary_part_added_event import Part as AddedPart
from openai.types.responses.response_reasoning_summary_part_done_event import Part as DonePart
from openai.types.responses.response_usage import InputTokensDetails, OutputTokensDetails

__all__ = ["Answer", "Fail", "Drop", "FakeModel", "NoDelayHandler", "Recorded", "context_overflow"]


@dataclass
class Answer:
    text: str | None = None
    # (name, JSON arguments) per call.
    tool_calls: list[tuple[str, str]] = field(default_factory=list)
    reasoning: str | None = None
    usage: tuple[int, int] = (10, 5)
    chunk_chars: int = 4
    hold: threading.Event | None = None
    # Responses API only: how the stream ends (``response.completed``,
    # ``response.failed`` with this error code, ``response.incomplete`` for
    # max_output_tokens, or an ``error`` event with this code).
    ending: str = "completed"
    error_code: str = "server_error"


@dataclass
class Fail:
    status: int
    message: str = "failed"
    code: str | None = None
    type: str = "server_error"
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Drop:
    pass


Reply = Answer | Fail | Drop


def context_overflow() -> Fail:
    return Fail(
        400,
        "This model's maximum context length is 128000 tokens. However, your messages resulted in 130000 tokens.",
        code="context_length_exceeded",
        type="invalid_request_error",
    )


@dataclass
class Recorded:
    path: str
    body: dict[str, Any]
    authorization: str
    received_at: float
    answered_at: float = 0.0
    # When the answer's first text chunk was written (0 without text).
    first_text_at: float = 0.0


def _chunks(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


def _chat_events(reply: Answer, model: str, index: int) -> list[tuple[str, bool]]:
    """(payload, is_first_text) per SSE event of a chat stream."""
    out: list[tuple[str, bool]] = []

    def chunk(delta: ChoiceDelta, finish: Any = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=f"chatcmpl-{index}",
            object="chat.completion.chunk",
            created=1_760_000_000,
            model=model,
            choices=[Choice(index=0, delta=delta, finish_reason=finish)],
        )

    out.append((chunk(ChoiceDelta(role="assistant", content="")).model_dump_json(exclude_none=True), False))
    if reply.reasoning:
        for part in _chunks(reply.reasoning, reply.chunk_chars):
            out.append((chunk(ChoiceDelta(reasoning_content=part)).model_dump_json(exclude_none=True), False))  # type: ignore[call-arg]
    first = True
    for part in _chunks(reply.text or "", reply.chunk_chars) if reply.text else []:
        out.append((chunk(ChoiceDelta(content=part)).model_dump_json(exclude_none=True), first))
        first = False
    for n, (name, arguments) in enumerate(reply.tool_calls):
        pieces = _chunks(arguments, max(1, len(arguments) // 3 + 1))
        head = ChoiceDeltaToolCall(
            index=n,
            id=f"call_{index}_{n}",
            type="function",
            function=ChoiceDeltaToolCallFunction(name=name, arguments=pieces[0]),
        )
        out.append((chunk(ChoiceDelta(tool_calls=[head])).model_dump_json(exclude_none=True), False))
        for piece in pieces[1:]:
            rest = ChoiceDeltaToolCall(index=n, function=ChoiceDeltaToolCallFunction(arguments=piece))
            out.append((chunk(ChoiceDelta(tool_calls=[rest])).model_dump_json(exclude_none=True), False))
    finish = "tool_calls" if reply.tool_calls else "stop"
    out.append((chunk(ChoiceDelta(), finish).model_dump_json(exclude_none=True), False))
    prompt, completion = reply.usage
    usage = ChatCompletionChunk(
        id=f"chatcmpl-{index}",
        object="chat.completion.chunk",
        created=1_760_000_000,
        model=model,
        choices=[],
        usage=CompletionUsage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion),
    )
    out.append((usage.model_dump_json(exclude_none=True), False))
    return out


def _responses_events(reply: Answer, model: str, index: int) -> list[tuple[str, bool]]:
    events: list[tuple[Any, bool]] = []
    seq = 0

    def nxt() -> int:
        nonlocal seq
        seq += 1
        return seq

    def response(status: Any, output: list[Any], usage: ResponseUsage | None) -> Response:
        return Response(
            id=f"resp_{index}",
            object="response",
            created_at=1_760_000_000,
            model=model,
            status=status,
            output=output,
            parallel_tool_calls=True,
            tool_choice="auto",
            tools=[],
            usage=usage,
        )

    events.append((ResponseCreatedEvent(type="response.created", sequence_number=nxt(), response=response("in_progress", [], None)), False))
    output: list[Any] = []
    position = 0
    if reply.reasoning:
        rid = f"rs_{index}"
        events.append(
            (
                ResponseOutputItemAddedEvent(
                    type="response.output_item.added",
                    sequence_number=nxt(),
                    output_index=position,
                    item=ResponseReasoningItem(id=rid, type="reasoning", summary=[]),
                ),
                False,
            )
        )
        scope = {"item_id": rid, "output_index": position, "summary_index": 0}
        events.append(
            (
                ResponseReasoningSummaryPartAddedEvent(
                    type="response.reasoning_summary_part.added",
                    sequence_number=nxt(),
                    part=AddedPart(type="summary_text", text=""),
                    **scope,
                ),
                False,
            )
        )
        for part in _chunks(reply.reasoning, reply.chunk_chars):
            events.append(
                (
                    ResponseReasoningSummaryTextDeltaEvent(
                        type="response.reasoning_summary_text.delta", sequence_number=nxt(), delta=part, **scope
                    ),
                    False,
                )
            )
        events.append(
            (
                ResponseReasoningSummaryTextDoneEvent(
                    type="response.reasoning_summary_text.done", sequence_number=nxt(), text=reply.reasoning, **scope
                ),
                False,
            )
        )
        events.append(
            (
                ResponseReasoningSummaryPartDoneEvent(
                    type="response.reasoning_summary_part.done",
                    sequence_number=nxt(),
                    part=DonePart(type="summary_text", text=reply.reasoning),
                    **scope,
                ),
                False,
            )
        )
        item = ResponseReasoningItem(
            id=rid,
            type="reasoning",
            summary=[Summary(type="summary_text", text=reply.reasoning)],
            encrypted_content=f"enc-{index}",
        )
        events.append(
            (ResponseOutputItemDoneEvent(type="response.output_item.done", sequence_number=nxt(), output_index=position, item=item), False)
        )
        output.append(item)
        position += 1
    if reply.text:
        mid = f"msg_{index}"
        events.append(
            (
                ResponseOutputItemAddedEvent(
                    type="response.output_item.added",
                    sequence_number=nxt(),
                    output_index=position,
                    item=ResponseOutputMessage(id=mid, type="message", role="assistant", status="in_progress", content=[]),
                ),
                False,
            )
        )
        first = True
        for part in _chunks(reply.text, reply.chunk_chars):
            events.append(
                (
                    ResponseTextDeltaEvent(
                        type="response.output_text.delta",
                        sequence_number=nxt(),
                        item_id=mid,
                        output_index=position,
                        content_index=0,
                        delta=part,
                        logprobs=[],
                    ),
                    first,
                )
            )
            first = False
        events.append(
            (
                ResponseTextDoneEvent(
                    type="response.output_text.done",
                    sequence_number=nxt(),
                    item_id=mid,
                    output_index=position,
                    content_index=0,
                    text=reply.text,
                    logprobs=[],
                ),
                False,
            )
        )
        message = ResponseOutputMessage(
            id=mid,
            type="message",
            role="assistant",
            status="completed",
            content=[ResponseOutputText(type="output_text", text=reply.text, annotations=[])],
        )
        events.append(
            (ResponseOutputItemDoneEvent(type="response.output_item.done", sequence_number=nxt(), output_index=position, item=message), False)
        )
        output.append(message)
        position += 1
    for n, (name, arguments) in enumerate(reply.tool_calls):
        call = ResponseFunctionToolCall(
            id=f"fc_{index}_{n}", type="function_call", call_id=f"call_{index}_{n}", name=name, arguments=arguments, status="completed"
        )
        events.append(
            (ResponseOutputItemDoneEvent(type="response.output_item.done", sequence_number=nxt(), output_index=position, item=call), False)
        )
        output.append(call)
        position += 1
    prompt, completion = reply.usage
    usage = ResponseUsage(
        input_tokens=prompt,
        output_tokens=completion,
        total_tokens=prompt + completion,
        input_tokens_details=InputTokensDetails(cached_tokens=0, cache_write_tokens=0),
        output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
    )
    if reply.ending == "failed":
        failed = response("failed", output, usage)
        # Constructed, not validated: the API adds error codes the SDK does not list yet.
        failed.error = ResponseError.model_construct(code=cast(Any, reply.error_code), message="the model failed")
        events.append((ResponseFailedEvent(type="response.failed", sequence_number=nxt(), response=failed), False))
    elif reply.ending == "incomplete":
        cut = response("incomplete", output, usage)
        cut.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        events.append((ResponseIncompleteEvent(type="response.incomplete", sequence_number=nxt(), response=cut), False))
    elif reply.ending == "error":
        events.append((ResponseErrorEvent(type="error", sequence_number=nxt(), code=reply.error_code, message="stream error", param=None), False))
    else:
        events.append((ResponseCompletedEvent(type="response.completed", sequence_number=nxt(), response=response("completed", output, usage)), False))
    return [(e.model_dump_json(exclude_none=True), first_text) for e, first_text in events]


class NoDelayHandler(BaseHTTPRequestHandler):
    """An HTTP/1.1 handler whose connection sends each write at once
    (``TCP_NODELAY``): small writes on a kept-alive connection would
    otherwise wait for the peer's delayed ACK (Nagle)."""

    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:
        return None


class FakeModel:
    """The server; a context manager that runs it in a thread."""

    def __init__(
        self,
        script: list[Reply] | None = None,
        *,
        default: Reply | None = None,
        respond: Callable[[dict[str, Any]], Reply] | None = None,
        keep_alive: bool = False,
    ) -> None:
        self.script: list[Reply] = list(script or [])
        self.keep_alive = keep_alive
        self.default: Reply = default or Fail(400, "unexpected request", type="invalid_request_error")
        self.respond = respond
        self.requests: list[Recorded] = []
        # Set after the first text chunk of an answer was written (and flushed).
        self.first_text_sent = threading.Event()
        self._lock = threading.Lock()
        fake = self

        class Handler(NoDelayHandler):
            def do_POST(self) -> None:  # noqa: N802 - the stdlib's naming
                fake._handle(self)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-model", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def paths(self) -> list[str]:
        return [r.path for r in self.requests]

    @property
    def bodies(self) -> list[dict[str, Any]]:
        return [r.body for r in self.requests]

    def _next(self, path: str, body: dict[str, Any], authorization: str) -> tuple[Reply, Recorded, int]:
        with self._lock:
            record = Recorded(path, body, authorization, time.monotonic())
            self.requests.append(record)
            index = len(self.requests) - 1
            respond = self.respond
            reply = self.script.pop(0) if self.script else None
        if reply is None:
            reply = respond(body) if respond is not None else self.default
        return reply, record, index

    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        body = json.loads(handler.rfile.read(length) or b"{}")
        reply, record, index = self._next(handler.path, body, handler.headers.get("Authorization", ""))
        try:
            if isinstance(reply, Drop):
                handler.close_connection = True
                handler.connection.shutdown(socket.SHUT_RDWR)
                return
            if isinstance(reply, Fail):
                payload = json.dumps(
                    {"error": {"message": reply.message, "type": reply.type, "param": None, "code": reply.code}}
                ).encode()
                handler.send_response(reply.status)
                for name, value in reply.headers.items():
                    handler.send_header(name, value)
                handler.send_header("Content-Type", "application/json")
                handler.send_header("Content-Length", str(len(payload)))
                handler.end_headers()
                handler.wfile.write(payload)
                return
            if handler.path == "/v1/chat/completions":
                events = _chat_events(reply, str(body.get("model", "")), index)
                done_marker = True
            elif handler.path == "/v1/responses":
                events = _responses_events(reply, str(body.get("model", "")), index)
                done_marker = False
            else:
                handler.send_error(404)
                return
            handler.send_response(200)
            handler.send_header("Content-Type", "text/event-stream")
            handler.send_header("Cache-Control", "no-cache")
            if self.keep_alive:
                handler.send_header("Transfer-Encoding", "chunked")
            else:
                handler.send_header("Connection", "close")
                handler.close_connection = True
            handler.end_headers()

            def send(data: bytes) -> None:
                if self.keep_alive:
                    data = b"%x\r\n%s\r\n" % (len(data), data)
                handler.wfile.write(data)
                handler.wfile.flush()

            for payload_text, first_text in events:
                prefix = ""
                if not done_marker:
                    prefix = f"event: {json.loads(payload_text)['type']}\n"
                send(f"{prefix}data: {payload_text}\n\n".encode())
                if first_text:
                    record.first_text_at = time.monotonic()
                    self.first_text_sent.set()
                    if reply.hold is not None:
                        reply.hold.wait(timeout=60)
            if done_marker:
                send(b"data: [DONE]\n\n")
            if self.keep_alive:
                handler.wfile.write(b"0\r\n\r\n")
            handler.wfile.flush()
        finally:
            record.answered_at = time.monotonic()

    def __enter__(self) -> FakeModel:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
