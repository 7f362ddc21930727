"""The client side of ``bench scale``, in a process of its own: sessions with
a live SSE stream each, running scripted ``$ true`` turns back to back.

    python -m bench.scale_client --client BASE_URL KEY SESSIONS SECONDS

It creates ``SESSIONS`` sessions (each with its own environment) and warms
each with one turn (the sandbox is provisioned then). Then every session
runs turns for ``SECONDS``: POST the input, wait for ``turn.completed`` on
its stream, wait for ``session.idle``, again. It prints JSON: the turns
completed in the window, the window, each turn's latency (ms, POST to
``turn.completed``) and the count of events seen twice or missing (by
sequence number), which must be zero.

Each session has an HTTP client of its own (its stream's connection and
the one it posts on): httpcore scans its whole pool on every request and
every response, so one pool shared by 200 sessions (400 connections) cost
the client more CPU per turn than the Session service spends on it."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import httpx

from bench.turn_client import TurnStream, create_session, turn_stream

_CREATE_CONCURRENCY = 16


async def _create(http: httpx.AsyncClient, gate: asyncio.Semaphore) -> str:
    async with gate:
        return str((await create_session(http))["id"])


async def _session(
    client: _Client, session_id: str, gate: asyncio.Semaphore, warm: _Countdown, start: asyncio.Event, stop: asyncio.Event
) -> tuple[list[float], list[float], TurnStream]:
    """Runs turns on one session; returns (turn latencies in the window,
    completion times, the stream's counters)."""
    samples: list[float] = []
    ends: list[float] = []
    async with client() as http, turn_stream(http, session_id) as stream:
        async with gate:
            # The first turn provisions the sandbox.
            await stream.turn()
            await stream.until("agent.session.idle")
        warm.done()
        await start.wait()
        while not stop.is_set():
            t0 = time.perf_counter()
            await stream.turn()
            t1 = time.perf_counter()
            samples.append((t1 - t0) * 1000)
            ends.append(t1)
            await stream.until("agent.session.idle")
    return samples, ends, stream


_Client = Callable[[], httpx.AsyncClient]


async def run_load(base_url: str, key: str, sessions: int, seconds: float) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}", "OpenAI-Beta": "agents=v1"}
    # Idle connections are dropped before uvicorn's 5 s keep-alive closes them under a request.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=2.0)

    def client() -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=base_url, headers=headers, timeout=120, limits=limits)

    async with client() as http:
        gate = asyncio.Semaphore(_CREATE_CONCURRENCY)
        ids = await asyncio.gather(*(_create(http, gate) for _ in range(sessions)))
        start, stop = asyncio.Event(), asyncio.Event()
        warm = _Countdown(sessions)
        tasks = [asyncio.create_task(_session(client, sid, gate, warm, start, stop)) for sid in ids]
        await warm.wait(tasks)
        t0 = time.perf_counter()
        start.set()
        await asyncio.sleep(seconds)
        stop.set()
        window_end = t0 + seconds
        results = await asyncio.gather(*tasks)
    latencies = [s for samples, _, _ in results for s in samples]
    in_window = sum(1 for _, ends, _ in results for end in ends if end <= window_end)
    return {
        "sessions": sessions,
        "seconds": seconds,
        "turns": in_window,
        "latencies_ms": latencies,
        "repeats": sum(s.repeats for _, _, s in results),
        "gaps": sum(s.gaps for _, _, s in results),
    }


class _Countdown:
    def __init__(self, count: int) -> None:
        self._left = count
        self._zero = asyncio.Event()

    def done(self) -> None:
        self._left -= 1
        if self._left == 0:
            self._zero.set()

    async def wait(self, tasks: list[asyncio.Task[Any]]) -> None:
        """Returns when the count reaches zero; raises what a task raised first."""
        waiter = asyncio.ensure_future(self._zero.wait())
        while not waiter.done():
            await asyncio.wait([waiter, *[t for t in tasks if not t.done()]], return_when=asyncio.FIRST_COMPLETED)
            for task in tasks:
                if task.done() and task.exception() is not None:
                    waiter.cancel()
                    raise task.exception()  # type: ignore[misc]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--client", nargs=4, metavar=("BASE_URL", "KEY", "SESSIONS", "SECONDS"), required=True)
    base_url, key, sessions, seconds = parser.parse_args().client
    print(json.dumps(asyncio.run(run_load(base_url, key, int(sessions), float(seconds)))))


if __name__ == "__main__":
    main()
