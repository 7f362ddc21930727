"""The one small interface every model provider implements.

The harness keeps a provider-neutral transcript of JSON entries:

- ``{"role": "user", "text": str}``
- ``{"role": "assistant", "text": str}``
- ``{"role": "assistant", "tool_calls": [{"id", "name", "arguments"}]}``
- ``{"role": "tool", "call_id": str, "output": str}``
- ``{"role": "assistant", "reasoning": {"id", "summary": [str], "encrypted_content"}}``
  (reasoning the model produced; given back where the API needs it)

A provider streams a model call (``ModelProvider.stream``): text and
reasoning deltas as they arrive, a ``Retrying`` notice before it waits to
retry a failed attempt, and last the complete ``ModelResponse``.

``normalize_transcript`` puts every tool result right after its call (and
answers calls that never got one, e.g. after a cancel), which is the order
OpenAI-compatible APIs require.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "Entry",
    "ToolSpec",
    "ToolCall",
    "Usage",
    "ModelRequest",
    "ModelResponse",
    "ModelError",
    "ModelProvider",
    "normalize_transcript",
    "TextDelta",
    "ReasoningDelta",
    "Retrying",
    "Completed",
    "StreamEvent",
    "Reasoning",
    "complete",
]

Entry = dict[str, Any]

_MISSING_RESULT = "error: the tool call was interrupted before it returned a result"


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolCall:
    """A tool call as the model produced it; ``id`` is the model's call ID."""

    id: str
    name: str
    arguments: str

    def as_entry(self) -> dict[str, str]:
        return {"id": self.id, "name": self.name, "arguments": self.arguments}


@dataclass(frozen=True)
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0


@dataclass
class ModelRequest:
    model: str
    instructions: str | None
    transcript: list[Entry]
    tools: list[ToolSpec]
    text_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    reasoning_summary: str | None = None
    # Sent only when not the default ("auto" / "medium"), which servers other
    # than OpenAI's may not know.
    service_tier: str | None = None
    verbosity: str | None = None
    # The session's prompt_cache_options, as the OpenAI API's retention
    # ("in_memory" | "24h") and a cache key; sent only when set.
    prompt_cache_retention: str | None = None
    prompt_cache_key: str | None = None


@dataclass
class Reasoning:
    """Reasoning of one model response: its summary parts, and what the API
    needs to have it given back (the item ID, encrypted content)."""

    summary: list[str] = field(default_factory=list)
    id: str | None = None
    encrypted_content: str | None = None

    def as_entry(self) -> Entry:
        return {
            "role": "assistant",
            "reasoning": {"id": self.id, "summary": list(self.summary), "encrypted_content": self.encrypted_content},
        }


@dataclass
class ModelResponse:
    text: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    usage: Usage | None = None
    reasoning: list[Reasoning] = field(default_factory=list)


@dataclass(frozen=True)
class TextDelta:
    """New text of the response's message."""

    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    """New text of reasoning summary part ``summary_index`` of the response's
    reasoning item ``reasoning_index``."""

    text: str
    reasoning_index: int = 0
    summary_index: int = 0


@dataclass(frozen=True)
class Retrying:
    """The attempt failed with a retryable error; the provider waits
    ``delay_s`` before attempt ``attempt + 1``."""

    attempt: int
    delay_s: float
    code: str
    message: str


@dataclass(frozen=True)
class Completed:
    response: ModelResponse


StreamEvent = TextDelta | ReasoningDelta | Retrying | Completed


class ModelError(Exception):
    """A model call failed; ``code`` is a `SessionTurnError` code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ModelProvider(Protocol):
    def stream(self, request: ModelRequest) -> AsyncIterator[StreamEvent]:
        """The events of one model call, ending with ``Completed``; raises
        ModelError when the call fails for good."""
        ...


async def complete(provider: ModelProvider, request: ModelRequest) -> ModelResponse:
    """The complete response of one model call, ignoring its deltas."""
    async for event in provider.stream(request):
        if isinstance(event, Completed):
            return event.response
    raise ModelError("server_error", "the model stream ended without a response")


def normalize_transcript(entries: list[Entry]) -> list[Entry]:
    results: dict[str, Entry] = {}
    for entry in entries:
        if entry.get("role") == "tool":
            results.setdefault(str(entry.get("call_id")), entry)
    out: list[Entry] = []
    for entry in entries:
        role = entry.get("role")
        if role == "tool":
            continue
        out.append(entry)
        for call in entry.get("tool_calls") or ():
            call_id = str(call["id"])
            out.append(results.get(call_id) or {"role": "tool", "call_id": call_id, "output": _MISSING_RESULT})
    return out
