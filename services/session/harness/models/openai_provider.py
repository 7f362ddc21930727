"""Any OpenAI-compatible server through the ``openai`` package: Chat
Completions by default, the Responses API when ``model_api == "responses"``.
Both are streamed: text and reasoning deltas are passed on as they arrive.
Failed attempts are retried here (see ``RetryPolicy``), not by the client.

Reasoning is given back to the Responses API as reasoning items (ID,
summary and encrypted content, as the API requires before the function
calls that followed it); Chat Completions servers take no reasoning in
their input, so it is left out there.

Function names there are limited to ``[A-Za-z0-9_-]{1,64}``, while MCP tools
are named ``<server_label>.<tool>``: such names are mapped to valid ones on
the way out (tool definitions and past calls alike) and back on the way in."""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import hashlib
import random
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import httpx2
import openai
import orjson
from openai.types.chat import ChatCompletion
from openai.types.responses import Response

from services.session.harness.models.base import (
    Completed,
    ModelError,
    ModelRequest,
    ModelResponse,
    Reasoning,
    ReasoningDelta,
    Retrying,
    StreamEvent,
    TextDelta,
    ToolCall,
    ToolSpec,
    Usage,
    complete,
    normalize_transcript,
)

__all__ = ["OpenAIProvider", "RetryPolicy", "wire_name", "error_code", "retryable", "retry_after_s"]


_VALID_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_INVALID_CHARS = re.compile(r"[^A-Za-z0-9_-]")


def wire_name(name: str) -> str:
    """A valid function name for ``name``: unchanged when already valid;
    otherwise dots become ``__``, other characters ``_``, and a hash suffix
    keeps overlong or colliding names distinct."""
    if _VALID_NAME.match(name):
        return name
    candidate = _INVALID_CHARS.sub("_", name.replace(".", "__"))
    if 0 < len(candidate) <= 64 and candidate != name:
        return candidate
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{candidate[:55]}_{digest}"


class _Names:
    """The name mapping of one request, with collisions resolved."""

    def __init__(self, tools: list[ToolSpec]) -> None:
        self.out: dict[str, str] = {}
        self.back: dict[str, str] = {}
        valid = {t.name for t in tools if _VALID_NAME.match(t.name)}
        for name in sorted(valid):
            self.out[name] = name
            self.back[name] = name
        for tool in tools:
            if tool.name in self.out:
                continue
            wired = wire_name(tool.name)
            if wired in self.back:
                digest = hashlib.sha256(tool.name.encode()).hexdigest()[:8]
                wired = f"{_INVALID_CHARS.sub('_', tool.name)[:55]}_{digest}"
            self.out[tool.name] = wired
            self.back[wired] = tool.name

    def to_wire(self, name: str) -> str:
        return self.out.get(name) or wire_name(name)

    def from_wire(self, name: str) -> str:
        return self.back.get(name, name)


_TURN_ERROR_CODES = frozenset(
    {
        "context_length_exceeded",
        "max_output_tokens",
        "usage_limit_exceeded",
        "rate_limit_exceeded",
        "server_overloaded",
        "connection_failed",
        "server_error",
        "authentication_error",
        "invalid_request",
        "resource_not_found",
        "request_timeout",
    }
)
_CONTEXT_MESSAGES = ("context_length_exceeded", "maximum context length", "context length", "context window")


def _body_code(exc: openai.APIError) -> str:
    body: dict[str, Any] = exc.body if isinstance(exc.body, dict) else {}
    inner = body.get("error")
    source: dict[str, Any] = inner if isinstance(inner, dict) else body
    return str(source.get("code") or "")


def _is_context_overflow(exc: openai.APIError) -> bool:
    text = f"{_body_code(exc)} {exc.message}".lower()
    return any(marker in text for marker in _CONTEXT_MESSAGES)


def _dropped(exc: BaseException) -> bool:
    """Whether the connection failed without a timeout: the SDK's aiohttp
    transport reports every aiohttp connection error, a dropped connection
    included, as a connect timeout, and only the cause tells them apart."""
    cause = exc.__cause__
    while cause is not None:
        if isinstance(cause, TimeoutError):  # aiohttp's timeouts included
            return False
        if isinstance(cause, aiohttp.ClientConnectionError):
            return True
        cause = cause.__cause__
    return False


def _transport_code(exc: httpx2.TransportError) -> str:
    """The code of a transport error raised while a stream was read."""
    return "request_timeout" if isinstance(exc, httpx2.TimeoutException) and not _dropped(exc) else "connection_failed"


def error_code(exc: openai.OpenAIError) -> str:
    """The `SessionTurnError` code of a failed model call."""
    if isinstance(exc, openai.APITimeoutError) and not _dropped(exc):
        return "request_timeout"
    if isinstance(exc, openai.APIConnectionError):
        return "connection_failed"
    if isinstance(exc, openai.AuthenticationError | openai.PermissionDeniedError):
        return "authentication_error"
    if isinstance(exc, openai.RateLimitError):
        return "usage_limit_exceeded" if _body_code(exc) == "insufficient_quota" else "rate_limit_exceeded"
    if isinstance(exc, openai.NotFoundError):
        return "resource_not_found"
    if isinstance(exc, openai.BadRequestError | openai.UnprocessableEntityError):
        return "context_length_exceeded" if _is_context_overflow(exc) else "invalid_request"
    if isinstance(exc, openai.InternalServerError):
        return "server_overloaded" if exc.status_code in (503, 529) else "server_error"
    if isinstance(exc, openai.APIStatusError):
        return "context_length_exceeded" if exc.status_code == 413 else "server_error"
    if isinstance(exc, openai.APIError):
        # An error event inside the stream.
        if _is_context_overflow(exc):
            return "context_length_exceeded"
        code = _body_code(exc) or str(getattr(exc, "code", "") or "")
        return code if code in _TURN_ERROR_CODES else "server_error"
    return "internal_error"


def retryable(exc: BaseException) -> bool:
    """429 (except an exhausted quota), 408, 409, 5xx and connection errors."""
    if isinstance(exc, httpx2.TransportError | openai.APIConnectionError):
        return True
    if isinstance(exc, openai.RateLimitError):
        return _body_code(exc) != "insufficient_quota"
    if isinstance(exc, openai.APIStatusError):
        return exc.status_code in (408, 409) or exc.status_code >= 500
    return False


def retry_after_s(exc: BaseException) -> float | None:
    """The wait the server asked for (``retry-after-ms`` or ``Retry-After``
    in seconds or as an HTTP date), if any."""
    response = getattr(exc, "response", None)
    if not isinstance(response, httpx2.Response):
        return None
    headers = response.headers
    with contextlib.suppress(ValueError):
        if "retry-after-ms" in headers:
            return max(0.0, float(headers["retry-after-ms"]) / 1000)
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter between attempts, at most
    ``max_retries`` retries; a server's ``Retry-After`` is honoured (never
    waited less), and one longer than ``max_delay_s`` ends the retries."""

    max_retries: int = 4
    base_delay_s: float = 0.5
    max_delay_s: float = 30.0

    def delay(self, attempt: int, exc: BaseException) -> float | None:
        """The wait before retry ``attempt`` (1-based); None to give up."""
        if attempt > self.max_retries:
            return None
        asked = retry_after_s(exc)
        if asked is not None:
            if asked > self.max_delay_s:
                return None
            # A little jitter on top, so clients told the same do not return together.
            return float(asked + random.uniform(0, min(1.0, asked * 0.1)))
        ceiling = min(self.max_delay_s, self.base_delay_s * 2 ** (attempt - 1))
        return float(ceiling / 2 + random.uniform(0, ceiling / 2))


def _chat_messages(request: ModelRequest, names: _Names) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    for entry in normalize_transcript(request.transcript):
        role = entry.get("role")
        if "reasoning" in entry:
            continue
        if role == "user":
            messages.append({"role": "user", "content": str(entry.get("text", ""))})
        elif role == "tool":
            messages.append({"role": "tool", "tool_call_id": entry["call_id"], "content": str(entry.get("output", ""))})
        elif role == "assistant":
            calls = [
                {"id": c["id"], "type": "function", "function": {"name": names.to_wire(c["name"]), "arguments": c["arguments"]}}
                for c in entry.get("tool_calls") or ()
            ]
            previous = messages[-1] if messages else None
            if calls and previous is not None and previous["role"] == "assistant" and "tool_calls" not in previous:
                # Text and the calls that followed it are one assistant turn.
                previous["tool_calls"] = calls
                continue
            message: dict[str, Any] = {"role": "assistant", "content": entry.get("text") or None}
            if calls:
                message["tool_calls"] = calls
            messages.append(message)
    return messages


def _responses_input(request: ModelRequest, names: _Names) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for entry in normalize_transcript(request.transcript):
        role = entry.get("role")
        reasoning = entry.get("reasoning")
        if isinstance(reasoning, dict):
            if reasoning.get("id") or reasoning.get("encrypted_content"):
                item: dict[str, Any] = {
                    "type": "reasoning",
                    "summary": [{"type": "summary_text", "text": str(t)} for t in reasoning.get("summary") or ()],
                }
                if reasoning.get("id"):
                    item["id"] = reasoning["id"]
                if reasoning.get("encrypted_content"):
                    item["encrypted_content"] = reasoning["encrypted_content"]
                items.append(item)
            continue
        if role == "user":
            items.append({"role": "user", "content": str(entry.get("text", ""))})
        elif role == "tool":
            items.append({"type": "function_call_output", "call_id": entry["call_id"], "output": str(entry.get("output", ""))})
        elif role == "assistant":
            if entry.get("text"):
                items.append({"role": "assistant", "content": str(entry["text"])})
            for c in entry.get("tool_calls") or ():
                items.append(
                    {"type": "function_call", "call_id": c["id"], "name": names.to_wire(c["name"]), "arguments": c["arguments"]}
                )
    return items


def _prompt_cache(request: ModelRequest) -> dict[str, str]:
    """Chat Completions and Responses take the same two cache fields."""
    if not request.prompt_cache_retention:
        return {}
    out = {"prompt_cache_retention": request.prompt_cache_retention}
    if request.prompt_cache_key:
        out["prompt_cache_key"] = request.prompt_cache_key
    return out


def _tool_defs(tools: list[ToolSpec], api: str, names: _Names) -> list[dict[str, Any]]:
    if api == "responses":
        return [
            {"type": "function", "name": names.to_wire(t.name), "description": t.description, "parameters": t.parameters}
            for t in tools
        ]
    return [
        {
            "type": "function",
            "function": {"name": names.to_wire(t.name), "description": t.description, "parameters": t.parameters},
        }
        for t in tools
    ]


class _ChatCall:
    """A tool call of a chat stream, put together from its deltas."""

    def __init__(self) -> None:
        self.id = ""
        self.name = ""
        self.arguments: list[str] = []


def _chat_usage(u: _Json) -> Usage:
    return Usage(
        input_tokens=u.number("prompt_tokens"),
        output_tokens=u.number("completion_tokens"),
        cached_tokens=u.object("prompt_tokens_details").number("cached_tokens"),
        reasoning_tokens=u.object("completion_tokens_details").number("reasoning_tokens"),
    )


def _responses_usage(u: _Json) -> Usage:
    return Usage(
        input_tokens=u.number("input_tokens"),
        output_tokens=u.number("output_tokens"),
        cached_tokens=u.object("input_tokens_details").number("cached_tokens"),
        reasoning_tokens=u.object("output_tokens_details").number("reasoning_tokens"),
    )


class _Json:
    """Typed reads of a streamed JSON object: a missing or mistyped field
    reads as empty, as the SDK's lenient construction would leave it."""

    __slots__ = ("raw",)

    def __init__(self, raw: object) -> None:
        self.raw: dict[str, Any] = raw if isinstance(raw, dict) else {}

    def text(self, key: str) -> str:
        value = self.raw.get(key)
        return value if isinstance(value, str) else ""

    def number(self, key: str) -> int:
        value = self.raw.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    def object(self, key: str) -> _Json:
        return _Json(self.raw.get(key))

    def objects(self, key: str) -> list[_Json]:
        value = self.raw.get(key)
        return [_Json(v) for v in value] if isinstance(value, list) else []


def _chat_reasoning(delta: _Json) -> str:
    """Reasoning text of a chat delta: servers name it ``reasoning_content``
    (DeepSeek, vLLM) or ``reasoning`` (Ollama, OpenRouter, newer vLLM)."""
    return delta.text("reasoning_content") or delta.text("reasoning")


class OpenAIProvider:
    """One OpenAI-compatible endpoint. The openai client does not retry;
    ``RetryPolicy`` does, before anything of the attempt was streamed."""

    def __init__(
        self,
        *,
        base_url: str,
        api_key: str,
        api: Literal["chat", "responses"] = "chat",
        timeout_s: float = 600.0,
        retry: RetryPolicy | None = None,
    ) -> None:
        # aiohttp's transport (the SDK's own ``DefaultAioHttpClient``, with its
        # proxy and CA settings from the environment) costs less per request
        # than the default one.
        self._client = openai.AsyncOpenAI(
            base_url=base_url or None,
            api_key=api_key or "unused",
            timeout=timeout_s,
            max_retries=0,
            http_client=openai.DefaultAioHttpClient(timeout=timeout_s),
        )
        self._api = api
        self._retry = retry or RetryPolicy()

    async def close(self) -> None:
        await self._client.close()

    async def complete(self, request: ModelRequest) -> ModelResponse:
        return await complete(self, request)

    async def stream(self, request: ModelRequest) -> AsyncIterator[StreamEvent]:
        attempt = 0
        while True:
            streamed = False
            try:
                attempt_events = self._responses(request) if self._api == "responses" else self._chat(request)
                async with contextlib.aclosing(attempt_events):
                    async for event in attempt_events:
                        streamed = streamed or not isinstance(event, Completed)
                        yield event
                return
            except (openai.OpenAIError, httpx2.TransportError) as exc:
                code = error_code(exc) if isinstance(exc, openai.OpenAIError) else _transport_code(exc)
                message = f"model call failed: {exc}"
                if streamed or not retryable(exc):
                    raise ModelError(code, message) from exc
                attempt += 1
                delay = self._retry.delay(attempt, exc)
                if delay is None:
                    raise ModelError(code, f"model call failed after {attempt} attempts (retries exhausted): {exc}") from exc
                yield Retrying(attempt=attempt, delay_s=delay, code=code, message=message)
                await asyncio.sleep(delay)

    async def _post(self, path: str, cast_to: type[ChatCompletion | Response], body: dict[str, Any]) -> openai.AsyncStream[object]:
        """Posts ``body`` as built, serialized by orjson: the client's typed
        ``create`` transforms every message through typing introspection,
        and its JSON encoder is the harness's largest cost per call on a
        long transcript. Chunks and events are read as the JSON objects they
        are (``AsyncStream[object]``): building a typed one per event costs
        more than the rest of the harness's work between two model calls."""
        return await self._client.post(
            path, cast_to=cast_to, content=orjson.dumps(body), stream=True, stream_cls=openai.AsyncStream[object]
        )

    async def _chat(self, request: ModelRequest) -> AsyncGenerator[StreamEvent, None]:
        names = _Names(request.tools)
        kwargs: dict[str, Any] = {
            "model": request.model,
            "messages": _chat_messages(request, names),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if request.tools:
            kwargs["tools"] = _tool_defs(request.tools, "chat", names)
        if request.text_format and request.text_format.get("type") == "json_schema":
            kwargs["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": request.text_format["schema"]},
            }
        if request.reasoning_effort:
            kwargs["reasoning_effort"] = request.reasoning_effort
        if request.service_tier:
            kwargs["service_tier"] = request.service_tier
        if request.verbosity:
            kwargs["verbosity"] = request.verbosity
        kwargs.update(_prompt_cache(request))
        stream = await self._post("/chat/completions", ChatCompletion, kwargs)
        text: list[str] = []
        reasoning: list[str] = []
        calls: dict[int, _ChatCall] = {}
        usage: Usage | None = None
        choices_seen = False
        async with stream:
            async for raw in stream:
                chunk = _Json(raw)
                if isinstance(chunk.raw.get("usage"), dict):
                    usage = _chat_usage(chunk.object("usage"))
                for choice in chunk.objects("choices"):
                    if choice.number("index") != 0:
                        continue
                    choices_seen = True
                    delta = choice.object("delta")
                    thought = _chat_reasoning(delta)
                    if thought:
                        reasoning.append(thought)
                        yield ReasoningDelta(thought)
                    content = delta.text("content")
                    if content:
                        text.append(content)
                        yield TextDelta(content)
                    for part in delta.objects("tool_calls"):
                        call = calls.setdefault(part.number("index"), _ChatCall())
                        function = part.object("function")
                        call.id = part.text("id") or call.id
                        call.name += function.text("name")
                        if function.text("arguments"):
                            call.arguments.append(function.text("arguments"))
        if not choices_seen:
            raise ModelError("server_error", "the model returned no choices")
        tool_calls = [
            ToolCall(id=c.id or f"call_{index}", name=names.from_wire(c.name), arguments="".join(c.arguments) or "{}")
            for index, c in sorted(calls.items())
            if c.name
        ]
        response = ModelResponse(text="".join(text) or None, tool_calls=tool_calls, usage=usage)
        if reasoning:
            response.reasoning.append(Reasoning(summary=["".join(reasoning)]))
        yield Completed(response)

    async def _responses(self, request: ModelRequest) -> AsyncGenerator[StreamEvent, None]:
        names = _Names(request.tools)
        kwargs: dict[str, Any] = {"model": request.model, "input": _responses_input(request, names), "stream": True}
        if request.instructions:
            kwargs["instructions"] = request.instructions
        if request.tools:
            kwargs["tools"] = _tool_defs(request.tools, "responses", names)
        text: dict[str, Any] = {}
        if request.text_format and request.text_format.get("type") == "json_schema":
            text["format"] = {"type": "json_schema", "name": "output", "schema": request.text_format["schema"]}
        if request.verbosity:
            text["verbosity"] = request.verbosity
        if text:
            kwargs["text"] = text
        if request.service_tier:
            kwargs["service_tier"] = request.service_tier
        kwargs.update(_prompt_cache(request))
        if request.reasoning_effort or request.reasoning_summary:
            kwargs["reasoning"] = {
                k: v for k, v in (("effort", request.reasoning_effort), ("summary", request.reasoning_summary)) if v
            }
        stream = await self._post("/responses", Response, kwargs)
        texts: list[str] = []
        calls: list[ToolCall] = []
        reasoning: dict[int, Reasoning] = {}
        usage: Usage | None = None
        finished = False
        async with stream:
            async for raw in stream:
                if not isinstance(raw, dict):
                    continue
                event = _Json(raw)
                kind = event.text("type")
                if kind == "response.output_text.delta":
                    yield TextDelta(event.text("delta"))
                elif kind == "response.reasoning_summary_text.delta":
                    output_index = event.number("output_index")
                    index = list(reasoning).index(output_index) if output_index in reasoning else len(reasoning)
                    reasoning.setdefault(output_index, Reasoning())
                    yield ReasoningDelta(event.text("delta"), reasoning_index=index, summary_index=event.number("summary_index"))
                elif kind == "response.output_item.done":
                    item = event.object("item")
                    item_type = item.text("type")
                    if item_type == "message":
                        texts.extend(part.text("text") for part in item.objects("content") if part.text("type") == "output_text")
                    elif item_type == "function_call":
                        calls.append(
                            ToolCall(
                                id=item.text("call_id"),
                                name=names.from_wire(item.text("name")),
                                arguments=item.text("arguments") or "{}",
                            )
                        )
                    elif item_type == "reasoning":
                        entry = reasoning.setdefault(event.number("output_index"), Reasoning())
                        entry.id = item.text("id") or None
                        entry.summary = [part.text("text") for part in item.objects("summary")]
                        entry.encrypted_content = item.text("encrypted_content") or None
                elif kind in ("response.completed", "response.incomplete"):
                    finished = True
                    if isinstance(event.object("response").raw.get("usage"), dict):
                        usage = _responses_usage(event.object("response").object("usage"))
                    if kind == "response.incomplete":
                        reason = event.object("response").object("incomplete_details").text("reason")
                        raise ModelError(
                            "max_output_tokens" if reason == "max_output_tokens" else "server_error",
                            f"the model response is incomplete: {reason or 'unknown reason'}",
                        )
                elif kind == "response.failed":
                    error = event.object("response").object("error")
                    code = error.text("code") or "server_error"
                    message = error.text("message") or "the model response failed"
                    raise ModelError(code if code in _TURN_ERROR_CODES else "server_error", f"model call failed: {message}")
                elif kind == "error":
                    code, message = event.text("code"), event.text("message")
                    if any(marker in f"{code} {message}".lower() for marker in _CONTEXT_MESSAGES):
                        code = "context_length_exceeded"
                    raise ModelError(code if code in _TURN_ERROR_CODES else "server_error", f"model call failed: {message}")
        if not finished:
            raise ModelError("connection_failed", "the model stream ended before the response completed")
        response = ModelResponse(text="".join(texts) or None, tool_calls=calls, usage=usage)
        response.reasoning = [r for r in reasoning.values() if r.summary or r.id or r.encrypted_content]
        yield Completed(response)
