"""Any OpenAI-compatible server through the ``openai`` package: Chat
Completions by default, the Responses API when ``model_api == "responses"``.

Function names there are limited to ``[A-Za-z0-9_-]{1,64}``, while MCP tools
are named ``<server_label>.<tool>``: such names are mapped to valid ones on
the way out (tool definitions and past calls alike) and back on the way in."""

from __future__ import annotations

import hashlib
import re
from typing import Any, Literal

import openai

from services.session.harness.models.base import (
    ModelError,
    ModelRequest,
    ModelResponse,
    ToolCall,
    ToolSpec,
    Usage,
    normalize_transcript,
)

__all__ = ["OpenAIProvider", "wire_name"]


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


def _error_code(exc: openai.OpenAIError) -> str:
    if isinstance(exc, openai.APITimeoutError):
        return "request_timeout"
    if isinstance(exc, openai.APIConnectionError):
        return "connection_failed"
    if isinstance(exc, openai.AuthenticationError | openai.PermissionDeniedError):
        return "authentication_error"
    if isinstance(exc, openai.RateLimitError):
        return "rate_limit_exceeded"
    if isinstance(exc, openai.NotFoundError):
        return "resource_not_found"
    if isinstance(exc, openai.BadRequestError | openai.UnprocessableEntityError):
        body = exc.body if isinstance(exc.body, dict) else {}
        if body.get("code") == "context_length_exceeded":
            return "context_length_exceeded"
        return "invalid_request"
    if isinstance(exc, openai.InternalServerError):
        return "server_overloaded" if exc.status_code in (503, 529) else "server_error"
    if isinstance(exc, openai.APIStatusError):
        return "server_error"
    return "internal_error"


def _chat_messages(request: ModelRequest, names: _Names) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    for entry in normalize_transcript(request.transcript):
        role = entry.get("role")
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


def _attr(obj: Any, *names: str) -> int:
    for name in names:
        obj = getattr(obj, name, None) if obj is not None else None
    return int(obj or 0)


class OpenAIProvider:
    def __init__(self, *, base_url: str, api_key: str, api: Literal["chat", "responses"] = "chat", timeout_s: float = 600.0) -> None:
        self._client = openai.AsyncOpenAI(base_url=base_url or None, api_key=api_key or "unused", timeout=timeout_s, max_retries=2)
        self._api = api

    async def close(self) -> None:
        await self._client.close()

    async def complete(self, request: ModelRequest) -> ModelResponse:
        try:
            if self._api == "responses":
                return await self._responses(request)
            return await self._chat(request)
        except openai.OpenAIError as exc:
            raise ModelError(_error_code(exc), f"model call failed: {exc}") from exc

    async def _chat(self, request: ModelRequest) -> ModelResponse:
        names = _Names(request.tools)
        kwargs: dict[str, Any] = {"model": request.model, "messages": _chat_messages(request, names)}
        if request.tools:
            kwargs["tools"] = _tool_defs(request.tools, "chat", names)
        if request.text_format and request.text_format.get("type") == "json_schema":
            kwargs["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": request.text_format["schema"]},
            }
        if request.reasoning_effort:
            kwargs["reasoning_effort"] = request.reasoning_effort
        completion = await self._client.chat.completions.create(**kwargs)
        if not completion.choices:
            raise ModelError("server_error", "the model returned no choices")
        message = completion.choices[0].message
        calls = [
            ToolCall(id=c.id, name=names.from_wire(c.function.name), arguments=c.function.arguments or "{}")
            for c in message.tool_calls or ()
            if getattr(c, "function", None) is not None
        ]
        usage = None
        if completion.usage is not None:
            u = completion.usage
            usage = Usage(
                input_tokens=u.prompt_tokens,
                output_tokens=u.completion_tokens,
                cached_tokens=_attr(u, "prompt_tokens_details", "cached_tokens"),
                reasoning_tokens=_attr(u, "completion_tokens_details", "reasoning_tokens"),
            )
        return ModelResponse(text=message.content or None, tool_calls=calls, usage=usage)

    async def _responses(self, request: ModelRequest) -> ModelResponse:
        names = _Names(request.tools)
        kwargs: dict[str, Any] = {"model": request.model, "input": _responses_input(request, names)}
        if request.instructions:
            kwargs["instructions"] = request.instructions
        if request.tools:
            kwargs["tools"] = _tool_defs(request.tools, "responses", names)
        if request.text_format and request.text_format.get("type") == "json_schema":
            kwargs["text"] = {"format": {"type": "json_schema", "name": "output", "schema": request.text_format["schema"]}}
        if request.reasoning_effort:
            kwargs["reasoning"] = {"effort": request.reasoning_effort}
        response = await self._client.responses.create(**kwargs)
        texts: list[str] = []
        calls: list[ToolCall] = []
        for item in response.output or ():
            if item.type == "message":
                texts.extend(part.text for part in item.content if getattr(part, "type", "") == "output_text")
            elif item.type == "function_call":
                calls.append(ToolCall(id=item.call_id, name=names.from_wire(item.name), arguments=item.arguments or "{}"))
        usage = None
        if response.usage is not None:
            u = response.usage
            usage = Usage(
                input_tokens=u.input_tokens,
                output_tokens=u.output_tokens,
                cached_tokens=_attr(u, "input_tokens_details", "cached_tokens"),
                reasoning_tokens=_attr(u, "output_tokens_details", "reasoning_tokens"),
            )
        return ModelResponse(text="".join(texts) or None, tool_calls=calls, usage=usage)
