"""Server-sent events of a session's persisted event log.

Framing. Each event is ``id: <sequence>\\nevent: <type>\\ndata: <event JSON>\\n\\n``;
``Last-Event-ID: <sequence>`` resumes after that event (``0`` replays the
whole log); without the header the stream is live from the session's newest
event, which is what ``sessions.stream()`` needs. Keep-alives are one
comment line, ``: ping\\n``, sent once ``sse_keepalive_s`` passed without
anything sent (the service's own keep-alive messages count as a reason to
send one, at most one per half interval). The comment deliberately has
no blank line after it: the SDK's decoder (openai/_streaming.py) never
resets the last event ID, so after any ``id:`` line a lone blank line would
dispatch an empty event and make ``json.loads("")`` fail in the client. A
comment line followed directly by the next event is valid SSE and is
ignored by every decoder.

When a stream ends (found in the SDK, lib/streaming/agents/_streams.py,
lib/beta/agents/_stream.py and _result.py):

* ``GET /v1/agents/sessions/{id}/events`` is a live subscription and never
  ends on its own: ``sessions.stream()`` subscribes *before* submitting
  input, treats ``agent.session.idle`` after its turn (or
  ``agent.session.failed``) as the end and closes the connection itself, and
  raises if the server closes first. Tool handlers answer
  ``requires_action`` on the same connection, so that must not end it
  either. It ends only when the client disconnects, the service ends the
  stream (e.g. the session was deleted) or the gateway shuts down.
* ``POST /v1/agents/sessions`` with ``"stream": true`` replays the new
  session's log from its first event (``agent.session.created``) and ends
  after the ``agent.session.idle`` that follows the initial turn's
  ``turn.completed|failed|cancelled``, or after ``agent.session.failed`` —
  the same boundary the SDK's result collector uses. A plain ``for event in
  stream`` in the SDK reads until EOF, so the server must close here.
* No ``data: [DONE]`` sentinel is sent: the SDK stops on it but treats a
  clean close the same way, and raw clients would have to special-case it.

A failure of the gRPC stream after the response started is reported as one
``error`` event (``AgentSessionErrorEvent``), then the response ends.
Closing the HTTP connection cancels only the gRPC stream, never the turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from berth.session.v1 import session_pb2, session_service_pb2, session_service_pb2_grpc
from gateway import render
from gateway.errors import map_rpc_error
from services.core.ids import new_id
from services.core.logging import get_logger

__all__ = ["KEEPALIVE", "SSE_HEADERS", "format_event", "CreateStreamBoundary", "relay_session_events", "obfuscated"]

log = get_logger("berth.gateway.sse")

KEEPALIVE = b": ping\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

_TURN_END_PAYLOADS = frozenset({"turn_completed", "turn_failed", "turn_cancelled"})


def format_event(sequence: int | None, event_type: str, data: str) -> bytes:
    lines: list[str] = []
    if sequence is not None:
        lines.append(f"id: {sequence}")
    if event_type:
        lines.append(f"event: {event_type}")
    # Multi-line JSON still frames correctly: one data line per line.
    lines.extend(f"data: {line}" for line in (data.splitlines() or [""]))
    return ("\n".join(lines) + "\n\n").encode()


@dataclass
class CreateStreamBoundary:
    """Decides when the ``stream: true`` creation response ends: at the idle
    that follows the root turn's end (or the ``agent.session.budget_reached``
    that pauses the session there), or at ``agent.session.failed``."""

    root_turn_id: str = ""
    turn_ended: bool = field(default=False, init=False)

    def reached(self, event: session_pb2.SessionEvent) -> bool:
        kind = event.WhichOneof("payload")
        if kind == "session_failed":
            return True
        if kind in ("session_idle", "session_budget_reached"):
            return self.turn_ended
        if kind == "turn_created" and not self.root_turn_id:
            created = event.turn_created
            if not created.turn.HasField("subagent_id"):
                self.root_turn_id = created.turn_id or created.turn.id
        elif kind in _TURN_END_PAYLOADS and self.root_turn_id:
            ended: session_pb2.TurnEndedEvent = getattr(event, kind)
            if ended.turn_id == self.root_turn_id:
                self.turn_ended = True
        return False


def _dumps(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


# A frame's JSON is padded to a multiple of this many characters, plus a
# random extra of up to as many again.
_OBFUSCATION_BLOCK = 32


def obfuscated(payload: dict[str, Any]) -> str:
    """The event's JSON with ``obfuscation`` padding (the SDK's
    ``include_obfuscation``, on by default): random alphanumeric characters
    that make a frame's size say little about its content's, as the Responses
    API does against length side channels. The padding is spliced in as the
    last member, so the event is encoded once."""
    text = _dumps(payload)
    length = (-len(text)) % _OBFUSCATION_BLOCK + secrets.randbelow(_OBFUSCATION_BLOCK)
    padding = secrets.token_hex((length + 1) // 2)[:length]
    # A hex string needs no escaping; an event always has members.
    return f'{text[:-1]},"obfuscation":"{padding}"}}'


def _error_event(session_id: str, exc: grpc.RpcError) -> bytes:
    error = map_rpc_error(exc)
    payload = {
        "event_id": new_id("evt"),
        "type": "error",
        "session_id": session_id,
        "error": {"type": error.type, "code": error.code, "message": error.message, "param": error.param},
    }
    return format_event(None, "error", json.dumps(payload))


async def relay_session_events(
    stub: session_service_pb2_grpc.SessionServiceStub,
    session_id: str,
    *,
    after_sequence: int,
    keepalive_s: float,
    closing: asyncio.Event,
    boundary: CreateStreamBoundary | None = None,
    obfuscation: bool = True,
) -> AsyncIterator[bytes]:
    """SSE bytes for the session's events after ``after_sequence``, following
    live ones, until the service ends the stream, ``boundary`` is reached or
    ``closing`` is set. Cancelling the iterator cancels the gRPC call."""
    call = stub.StreamSessionEvents(
        session_service_pb2.StreamSessionEventsRequest(
            session_id=session_id,
            after_sequence=after_sequence,
            follow=True,
            keepalive_ms=int(keepalive_s * 1000),
        )
    )
    loop = asyncio.get_running_loop()
    closing_wait = asyncio.ensure_future(closing.wait())
    pending: asyncio.Future[object] | None = None
    last_sent = loop.time()
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(call.read())
            idle_left = max(0.0, keepalive_s - (loop.time() - last_sent))
            done, _ = await asyncio.wait({pending, closing_wait}, timeout=idle_left, return_when=asyncio.FIRST_COMPLETED)
            if closing_wait in done and pending not in done:
                return
            if pending not in done:
                # Idle: keep the connection (and proxies) alive; keep waiting
                # on the same read, since cancelling it would cancel the call.
                yield KEEPALIVE
                last_sent = loop.time()
                continue
            read, pending = pending, None
            try:
                message = read.result()
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.CANCELLED:
                    log.warning("event_stream_failed", session_id=session_id, code=exc.code().name)
                    yield _error_event(session_id, exc)
                return
            if message is grpc.aio.EOF:
                return
            assert isinstance(message, session_service_pb2.StreamSessionEventsResponse)
            kind = message.WhichOneof("message")
            if kind == "batch":
                events: Sequence[session_pb2.SessionEvent] = message.batch.events
            elif kind == "event":
                events = (message.event,)
            else:
                # The service's keep-alive (it keeps proxies between us and it
                # from idling the stream out); relayed unless we just sent one.
                if loop.time() - last_sent >= keepalive_s / 2:
                    yield KEEPALIVE
                    last_sent = loop.time()
                continue
            # One write per batch: the events of a commit leave together.
            frames: list[bytes] = []
            ended = False
            for event in events:
                payload = render.event(event)
                data = obfuscated(payload) if obfuscation else _dumps(payload)
                frames.append(format_event(event.sequence, event.type, data))
                if boundary is not None and boundary.reached(event):
                    ended = True
                    break
            if frames:
                yield b"".join(frames)
                last_sent = loop.time()
            if ended:
                return
    finally:
        closing_wait.cancel()
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        call.cancel()
