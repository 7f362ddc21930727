"""The one small interface every model provider implements.

The harness keeps a provider-neutral transcript of JSON entries:

- ``{"role": "user", "text": str}``
- ``{"role": "assistant", "text": str}``
- ``{"role": "assistant", "tool_calls": [{"id", "name", "arguments"}]}``
- ``{"role": "tool", "call_id": str, "output": str}``

``normalize_transcript`` puts every tool result right after its call (and
answers calls that never got one, e.g. after a cancel), which is the order
OpenAI-compatible APIs require.
"""

from __future__ import annotations

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


@dataclass
class ModelResponse:
    text: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    usage: Usage | None = None


class ModelError(Exception):
    """A model call failed; ``code`` is a `SessionTurnError` code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ModelProvider(Protocol):
    async def complete(self, request: ModelRequest) -> ModelResponse: ...


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
