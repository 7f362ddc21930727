"""Harness overhead against a model that answers instantly (the streaming
fake model server of ``tests/fake_model.py``, in a process of its own with
keep-alive: ``bench/model_process.py``), so neither the fake's work nor
connection set-up counts as the harness's.

- Per model call: a turn of 40 model responses with one tool call each (an
  ``exec_command`` on a session without an environment, so no tool work: the
  call's item is added and finished at once), then an answer. Measured at the
  model: from the moment a response was fully written to the moment the next
  request arrived, i.e. parsing the stream, writing the items and events,
  rebuilding the transcript and sending the next request. Baseline in the
  same run: the same gap for the bare ``openai`` client calling the fake in a
  loop (streamed, consumed, next call). Target: p50 under 5 ms.
- Time to first delta: a turn whose answer's first text chunk is written and
  then held; measured from that write to the ``output_text.delta`` event
  arriving on an already open SSE stream (read in this process). Baseline:
  the bare ``openai`` client's first content delta after the same write.
  Target: p50 under 10 ms.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import httpx
import openai

from bench.model_process import RemoteModel, Timing
from bench.turn_client import TurnStream
from bench.runner import Result, summarize
from bench.stack import running_stack

CALLS = int(os.environ.get("BENCH_HARNESS_CALLS", "40"))
TURNS = int(os.environ.get("BENCH_HARNESS_TURNS", "3"))
DELTAS = int(os.environ.get("BENCH_HARNESS_DELTAS", "40"))

_TOOL_CALL = {"tool_calls": [["exec_command", '{"command": "true"}']]}


def _gaps(requests: list[Timing]) -> list[float]:
    return [(b.received_at - a.answered_at) * 1000 for a, b in zip(requests, requests[1:], strict=False)]


async def _bare_client_gaps(model: RemoteModel, runs: int) -> list[float]:
    client = openai.AsyncOpenAI(base_url=model.base_url, api_key="x", max_retries=0)
    start = await model.count()
    await model.script([_TOOL_CALL] * runs)
    messages = [{"role": "user", "content": "go"}]
    for _ in range(runs):
        stream = await client.chat.completions.create(model="m", messages=messages, stream=True)  # type: ignore[arg-type]
        async for _chunk in stream:
            pass
    await client.close()
    return _gaps(await model.requests(start))


async def _bare_client_first_delta(model: RemoteModel, runs: int) -> list[float]:
    client = openai.AsyncOpenAI(base_url=model.base_url, api_key="x", max_retries=0)
    out: list[float] = []
    for _ in range(runs):
        await model.script([{"text": "hello there, streamed", "hold": True}])
        stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}], stream=True)
        first: float | None = None
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.monotonic()
                await model.release()
        assert first is not None, "the answer had no text"
        out.append((first - (await model.requests())[-1].first_text_at) * 1000)
    await client.close()
    return out


async def _wait_idle(http: httpx.AsyncClient, session_id: str) -> None:
    for _ in range(3000):
        status = (await http.get(f"/agents/sessions/{session_id}")).json()["status"]
        if status in ("idle", "failed"):
            return
        await asyncio.sleep(0.1)
    raise RuntimeError("the benchmark turn did not end")


async def run(tmp: Path) -> list[Result]:
    async with RemoteModel.start() as model:
        async with running_stack(tmp / "berth", model_base_url=model.base_url, model_api_key="x") as stack:
            headers = {"Authorization": f"Bearer {stack.key}", "OpenAI-Beta": "agents=v1"}
            async with httpx.AsyncClient(base_url=stack.base_url, headers=headers, timeout=60) as http:
                # Per model call.
                gaps: list[float] = []
                for turn in range(TURNS + 1):
                    start = await model.count()
                    await model.script([_TOOL_CALL] * CALLS + [{"text": "done"}])
                    created = await http.post(
                        "/agents/sessions", json={"agent": {"model": "m"}, "environment": {"type": "none"}, "input": "go"}
                    )
                    created.raise_for_status()
                    await _wait_idle(http, created.json()["id"])
                    if turn > 0:  # the first turn warms up
                        gaps.extend(_gaps(await model.requests(start)))
                base_gaps = await _bare_client_gaps(model, CALLS * TURNS)

                # Time to first delta.
                await model.script([{"text": "warm"}])
                created = await http.post(
                    "/agents/sessions", json={"agent": {"model": "m"}, "environment": {"type": "none"}, "input": "warm up"}
                )
                session_id = created.json()["id"]
                await _wait_idle(http, session_id)
                message = {
                    "events": [
                        {"type": "agent.session.input.message", "input": [{"role": "user", "content": [{"type": "input_text", "text": "go"}]}]}
                    ]
                }
                deltas: list[float] = []
                async with http.stream(
                    "GET", f"/agents/sessions/{session_id}/events", headers={"Last-Event-ID": "0"}, timeout=None
                ) as response:
                    events = TurnStream(http, session_id, response.aiter_lines())
                    await events.until("agent.session.idle")
                    for n in range(DELTAS + 3):
                        await model.script([{"text": "hello there, streamed", "hold": True}])
                        sent = await http.post(f"/agents/sessions/{session_id}/events", json=message)
                        sent.raise_for_status()
                        await events.until("agent.session.turn.output_text.delta")
                        seen = time.monotonic()
                        if n >= 3:
                            deltas.append((seen - (await model.requests())[-1].first_text_at) * 1000)
                        await model.release()
                        await events.until("agent.session.idle")
                base_deltas = await _bare_client_first_delta(model, DELTAS)
    return [
        summarize(
            "harness: model response -> next request", gaps, "bare openai client loop", base_gaps, "p50 < 5 ms"
        ),
        summarize(
            "harness: model's first chunk -> SSE delta", deltas, "bare openai client first delta", base_deltas, "p50 < 10 ms"
        ),
    ]
