"""The trace of one root turn: spans recorded in memory while the turn runs,
rendered as an OTLP JSON ``ExportTraceServiceRequest`` (the ``otlp`` of the
SDK's ``SessionTrace``).

The root span is the turn; its children are the spans the harness opens
with ``TurnTrace.span``, one kind each (``SPAN_KINDS``): a model call
(``model``: model name, input and output tokens; its duration is the
latency), a tool call (``tool``), a context compaction (``compaction``), a
wait (``wait``: application function results, a background compaction)
and a subagent's turn (``subagent``). A span opened inside another (in the
same task, or a task created inside it) is its child. Attributes follow the
OpenTelemetry GenAI conventions where they have one; nothing a tool or model
read or wrote is recorded.

A subagent's turns belong to the root turn whose tool call queued them: a
turn queued inside a span records that span's ``TraceLink`` (``current_link``)
with it, and its trace then continues the root turn's: same trace ID, its
root span a ``subagent`` span whose parent is the tool call that queued it,
its spans published under the root turn (``services/session/traces.py``).
A subagent's own subagents link the same way, to the same root turn."""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["TurnTrace", "TraceLink", "Span", "SpanKind", "SPAN_KINDS", "current_link"]

SpanKind = Literal["turn", "model", "tool", "compaction", "wait", "subagent"]
SPAN_KINDS: tuple[SpanKind, ...] = ("turn", "model", "tool", "compaction", "wait", "subagent")

# OTLP span kinds: INTERNAL, and CLIENT for calls to another service.
_INTERNAL = 1
_CLIENT = 3
# OTLP status codes.
_OK = 1
_ERROR = 2

Attribute = str | int | float | bool


def _hex_id(size: int) -> str:
    return os.urandom(size).hex()


@dataclass(frozen=True)
class TraceLink:
    """Where a queued turn's trace continues: the root turn, its trace and
    the span (a tool call) that queued it."""

    root_turn_id: str
    trace_id: str
    span_id: str

    def to_json(self) -> str:
        return json.dumps({"root_turn_id": self.root_turn_id, "trace_id": self.trace_id, "span_id": self.span_id})

    @classmethod
    def from_json(cls, raw: str) -> TraceLink | None:
        if not raw:
            return None
        data = json.loads(raw)
        return cls(str(data["root_turn_id"]), str(data["trace_id"]), str(data["span_id"]))


# The innermost open span of whatever trace the running task is in.
_LINK: contextvars.ContextVar[TraceLink | None] = contextvars.ContextVar("berth_trace_link", default=None)


def current_link() -> TraceLink | None:
    """The link a turn queued now would continue from (None outside a span)."""
    return _LINK.get()


@dataclass
class Span:
    kind: SpanKind
    name: str
    span_id: str
    parent_id: str | None
    start_ns: int
    end_ns: int = 0
    attributes: dict[str, Attribute] = field(default_factory=dict)
    error: str | None = None

    def set(self, **attributes: Attribute | None) -> None:
        """Adds attributes (dots in names are written as ``__``); None is skipped."""
        for key, value in attributes.items():
            if value is not None:
                self.attributes[key.replace("__", ".")] = value

    def fail(self, code: str) -> None:
        self.error = code


def _value(value: Attribute) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        # OTLP JSON carries 64-bit integers as strings.
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    return {"stringValue": value}


def _attributes(attributes: dict[str, Attribute]) -> list[dict[str, Any]]:
    return [{"key": k, "value": _value(v)} for k, v in attributes.items()]


class TurnTrace:
    """The spans of one turn: a root turn, or a subagent's turn that
    ``link`` ties to its root turn's trace."""

    def __init__(
        self, *, session_id: str, turn_id: str, service_name: str = "berth", link: TraceLink | None = None
    ) -> None:
        self.link = link
        self.trace_id = link.trace_id if link is not None else _hex_id(16)
        self.root_turn_id = link.root_turn_id if link is not None else turn_id
        self.service_name = service_name
        kind: SpanKind = "subagent" if link is not None else "turn"
        self.root = Span(kind, kind, _hex_id(8), link.span_id if link is not None else None, time.time_ns())
        self.root.set(berth__session_id=session_id, berth__turn_id=turn_id, berth__span_kind=kind)
        self.spans: list[Span] = [self.root]
        self._current: contextvars.ContextVar[Span] = contextvars.ContextVar(f"span-{turn_id}", default=self.root)

    @contextlib.contextmanager
    def span(self, kind: SpanKind, name: str, **attributes: Attribute | None) -> Iterator[Span]:
        """A child span of the current one, ended when the block ends; an
        exception (cancellation included) marks it failed."""
        parent = self._current.get()
        span = Span(kind, name, _hex_id(8), parent.span_id, time.time_ns())
        span.set(berth__span_kind=kind, **attributes)
        self.spans.append(span)
        token = self._current.set(span)
        link = _LINK.set(TraceLink(self.root_turn_id, self.trace_id, span.span_id))
        try:
            yield span
        except BaseException as exc:
            if span.error is None:
                span.fail(getattr(exc, "code", None) or type(exc).__name__)
            raise
        finally:
            _LINK.reset(link)
            self._current.reset(token)
            span.end_ns = time.time_ns()

    def end(self, status: str, error_code: str = "") -> None:
        """Ends the root span with the turn's outcome."""
        self.root.set(berth__turn_status=status)
        if error_code:
            self.root.fail(error_code)
        self.root.end_ns = time.time_ns()

    def _span_json(self, span: Span, now: int) -> dict[str, Any]:
        out: dict[str, Any] = {
            "traceId": self.trace_id,
            "spanId": span.span_id,
            "name": span.name,
            "kind": _CLIENT if span.kind == "model" else _INTERNAL,
            "startTimeUnixNano": str(span.start_ns),
            # A span still open (a published trace of a running turn) ends now.
            "endTimeUnixNano": str(span.end_ns or now),
            "attributes": _attributes(span.attributes),
            "status": {"code": _ERROR, "message": span.error} if span.error else {"code": _OK},
        }
        if span.parent_id:
            out["parentSpanId"] = span.parent_id
        return out

    def otlp(self) -> dict[str, Any]:
        """The OTLP JSON ExportTraceServiceRequest of the spans so far."""
        now = time.time_ns()
        return {
            "resourceSpans": [
                {
                    "resource": {"attributes": _attributes({"service.name": self.service_name})},
                    "scopeSpans": [
                        {"scope": {"name": "berth.harness"}, "spans": [self._span_json(s, now) for s in self.spans]}
                    ],
                }
            ]
        }
