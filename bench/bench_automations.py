"""Scheduler lag: from an automation's due time to its turn starting.

One session (no environment tools used) has an SSE stream open; one-time
automations targeting it fall due one per second (``run_at`` has whole-second
resolution). A sample is the wall-clock time at which the session's
``agent.session.turn.in_progress`` for that delivery arrives on the stream,
minus the automation's ``run_at``. The servers run in this process, as in
``berth serve``, with the default ``BERTH_AUTOMATION_POLL_S``.
Baseline in the same run: a manual invocation (POST .../invocations) to the
same turn event, i.e. the delivery path without the schedule.
Target: p50 under 1 s."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from bench.runner import Result, summarize
from bench.stack import running_stack

RUNS = int(os.environ.get("BENCH_AUTOMATION_RUNS", "15"))
STARTED = "agent.session.turn.in_progress"


async def _turn_starts(lines: AsyncIterator[str], arrivals: asyncio.Queue[float]) -> None:
    kind = ""
    async for line in lines:
        if line.startswith("event: "):
            kind = line[7:]
        elif line == "" and kind:
            if kind == STARTED:
                arrivals.put_nowait(time.time())
            kind = ""


async def run(tmp: Path) -> list[Result]:
    async with running_stack(tmp / "berth") as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, headers=stack.headers, timeout=60) as http:
            created = await http.post(
                "/agents/sessions", json={"agent": {"model": "scripted"}, "environment": {"type": "openai_hosted"}}
            )
            created.raise_for_status()
            session_id = created.json()["id"]
            target = {"type": "existing_session", "session_id": session_id, "instructions": "tick"}
            arrivals: asyncio.Queue[float] = asyncio.Queue()
            async with http.stream(
                "GET", f"/agents/sessions/{session_id}/events", headers={"Last-Event-ID": "0"}, timeout=None
            ) as stream:
                reader = asyncio.create_task(_turn_starts(stream.aiter_lines(), arrivals))
                try:
                    first = int(time.time()) + 2
                    due = [first + i for i in range(RUNS)]
                    for run_at in due:
                        response = await http.post(
                            "/agents/automations", json={"type": "once", "name": "lag", "run_at": run_at, "target": target}
                        )
                        response.raise_for_status()
                        automation_id = response.json()["id"]
                    samples = [(await asyncio.wait_for(arrivals.get(), 30) - run_at) * 1000 for run_at in due]

                    base: list[float] = []
                    for _ in range(RUNS):
                        t0 = time.time()
                        (await http.post(f"/agents/automations/{automation_id}/invocations")).raise_for_status()
                        base.append((await asyncio.wait_for(arrivals.get(), 30) - t0) * 1000)
                finally:
                    reader.cancel()
    return [
        summarize(
            "automation due time -> turn in_progress", samples, "manual invocation -> turn", base, "p50 < 1000 ms"
        )
    ]
