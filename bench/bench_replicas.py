"""Replicas hearing each other: two Session service replicas (A and B) on one
PostgreSQL database, in this process, each with its own engine and notifier.

- Cross-replica event latency: streams follow a session on A and on B; input
  submitted on A starts a turn in its transaction. The time from its first
  event arriving on A's stream (handed over in process right after commit)
  to its arriving on B's stream. Target: p50 under 20 ms.
- Cross-replica cancel latency: a turn runs on A, waiting for a tool result;
  the time from a cancel committed on B (its submit returned) to
  ``turn.cancelled`` arriving on a stream on A: the turn noticed the cancel,
  stopped and wrote its end. Target: p50 under 50 ms.

Baseline in the same run: the same two measurements with LISTEN/NOTIFY off
(``notify_listen=false``), i.e. the polling the replicas did before (events
every 0.2 s, cancels every 0.5 s). PostgreSQL comes from
``BERTH_BENCH_POSTGRES_URL`` (default: the local test server); a database of
its own is created and dropped."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.postgres import scratch_database
from bench.runner import Result, summarize
from bench.stack import INTERNAL_TOKEN, internal_channel
from berth.session.v1 import session_service_pb2 as pb
from berth.session.v1 import session_service_pb2_grpc as pb_grpc
from gateway import convert
from gateway.validation import SessionCreateBody, validate_body
from services.core.service import ServiceHandle
from services.core.settings import Settings
from services.core.wire_json import to_message
from services.session.server import start_session_service

EVENT_RUNS = int(os.environ.get("BENCH_REPLICA_EVENT_RUNS", "40"))
CANCEL_RUNS = int(os.environ.get("BENCH_REPLICA_CANCEL_RUNS", "20"))
WARMUP = 3
_ORG = (("x-berth-org", "org_bench"),)
_HOLD = {"model": "scripted", "tools": [{"type": "function", "name": "hold", "description": "", "parameters": {}}]}
_ENDED = {"agent.session.turn.completed", "agent.session.turn.failed", "agent.session.turn.cancelled"}


class _Follower:
    """A following stream: the arrival time and type of each event."""

    def __init__(self, stub: pb_grpc.SessionServiceStub, session_id: str) -> None:
        self.arrivals: list[tuple[float, int, str]] = []
        self.changed = asyncio.Event()
        self._call = stub.StreamSessionEvents(
            pb.StreamSessionEventsRequest(session_id=session_id, follow=True, keepalive_ms=20), metadata=_ORG
        )
        self.waiting = asyncio.Event()
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for m in self._call:
            now = time.perf_counter()
            if m.WhichOneof("message") == "keepalive_ms":
                self.waiting.set()
            for e in m.batch.events:
                self.arrivals.append((now, e.sequence, e.type))
            self.changed.set()

    async def until(self, predicate: Any, *, since: int = 0, timeout: float = 30.0) -> float:
        """The arrival time of the first event (from index ``since``) whose type matches ``predicate``.
        One turn runs at a time here: what follows ``since`` is that turn's."""
        async with asyncio.timeout(timeout):
            while True:
                for at, _, kind in self.arrivals[since:]:
                    if predicate(kind):
                        return at
                self.changed.clear()
                await self.changed.wait()

    async def close(self) -> None:
        self._call.cancel()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task


@dataclass
class _Replicas:
    a: pb_grpc.SessionServiceStub
    b: pb_grpc.SessionServiceStub

    async def create(self, agent: dict[str, Any]) -> str:
        body = validate_body(SessionCreateBody, {"agent": agent, "environment": {"type": "none"}})
        created = await self.a.CreateSession(convert.create_session_request(body), metadata=_ORG)
        return str(created.session.id)


def _say(text: str) -> pb.InputEvent:
    message = {"type": "agent.session.input.message", "input": [{"role": "user", "content": [{"type": "input_text", "text": text}]}]}
    return to_message(message, pb.InputEvent())


async def _submit(stub: pb_grpc.SessionServiceStub, session_id: str, event: Any) -> Any:
    return await stub.SubmitSessionEvents(pb.SubmitSessionEventsRequest(session_id=session_id, events=[event]), metadata=_ORG)


@asynccontextmanager
async def _replicas(data_dir: Path, url: str, *, listen: bool) -> AsyncIterator[_Replicas]:
    settings = Settings(
        data_dir=data_dir,
        session_database_url=url,
        notify_listen=listen,
        log_level="ERROR",
        internal_token=INTERNAL_TOKEN,
        # Sessions here have no environment: nothing calls this address.
        environment_addr="127.0.0.1:9",
    )
    handles: list[ServiceHandle] = []
    channels = []
    try:
        for _ in range(2):
            handles.append(await start_session_service(settings, address="127.0.0.1:0"))
        channels = [internal_channel(h.address, "gateway") for h in handles]
        yield _Replicas(pb_grpc.SessionServiceStub(channels[0]), pb_grpc.SessionServiceStub(channels[1]))
    finally:
        for channel in channels:
            await channel.close()
        for handle in handles:
            await handle.stop(0)


async def _event_latency(replicas: _Replicas, runs: int) -> list[float]:
    session_id = await replicas.create({"model": "scripted"})
    local, remote = _Follower(replicas.a, session_id), _Follower(replicas.b, session_id)
    samples: list[float] = []
    try:
        await asyncio.wait_for(asyncio.gather(local.waiting.wait(), remote.waiting.wait()), 10)
        for i in range(WARMUP + runs):
            since_local, since_remote = len(local.arrivals), len(remote.arrivals)
            await _submit(replicas.a, session_id, _say(f"hello {i}"))
            committed = await local.until(lambda _k: True, since=since_local)
            seen = await remote.until(lambda _k: True, since=since_remote)
            await remote.until(lambda k: k == "agent.session.idle", since=since_remote)
            await local.until(lambda k: k == "agent.session.idle", since=since_local)
            if i >= WARMUP:
                samples.append((seen - committed) * 1000)
    finally:
        await local.close()
        await remote.close()
    return samples


async def _cancel_latency(replicas: _Replicas, runs: int) -> list[float]:
    session_id = await replicas.create(_HOLD)
    follower = _Follower(replicas.a, session_id)
    samples: list[float] = []
    cancel = to_message({"type": "agent.session.input.cancel"}, pb.InputEvent())
    try:
        await asyncio.wait_for(follower.waiting.wait(), 10)
        for i in range(WARMUP + runs):
            since = len(follower.arrivals)
            await _submit(replicas.a, session_id, _say("call hold"))
            await follower.until(lambda k: k == "agent.session.requires_action", since=since)
            since = len(follower.arrivals)
            await _submit(replicas.b, session_id, cancel)
            t0 = time.perf_counter()  # the cancel is committed
            end = await follower.until(lambda k: k in _ENDED, since=since)
            await follower.until(lambda k: k == "agent.session.idle", since=since)
            if i >= WARMUP:
                samples.append((end - t0) * 1000)
    finally:
        await follower.close()
    return samples


async def run(tmp: Path) -> list[Result]:
    measured: dict[bool, tuple[list[float], list[float]]] = {}
    async with scratch_database() as url:
        for listen in (False, True):
            async with _replicas(tmp / f"listen-{listen}", url, listen=listen) as replicas:
                events = await _event_latency(replicas, EVENT_RUNS)
                cancels = await _cancel_latency(replicas, CANCEL_RUNS)
            measured[listen] = (events, cancels)
    (events, cancels), (poll_events, poll_cancels) = measured[True], measured[False]
    return [
        summarize("replicas: event on A seen by B's stream", events, "polling (0.2 s)", poll_events, "p50 < 20 ms"),
        summarize("replicas: cancel on B reaches turn on A", cancels, "polling (0.5 s)", poll_cancels, "p50 < 50 ms"),
    ]
