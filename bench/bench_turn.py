"""Turn overhead, warm: a scripted one-command turn (``$ true``) from the
POST of its input event to ``agent.session.turn.completed`` arriving on an
SSE stream that is already open, on a session whose environment is ready.

The HTTP client runs in a process of its own (``python -m bench.bench_turn
--client``), as a user's client does: in the servers' process its parsing
would be billed to the turn. The servers (sandbox, environment, session,
gateway) share this process and its event loop, as in ``berth serve``.
Baseline in the same run: a warm exec of ``true`` straight through the
Environment service's ExecCommand RPC, i.e. the compute part of the turn
without the turn machinery (session DB, harness loop, event log, SSE).
Target: p50 under 30 ms."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from bench.runner import Result, measure, run_client, summarize
from bench.stack import internal_channel, running_stack
from bench.turn_client import create_session, turn_stream
from berth.environment.v1 import environment_service_pb2 as env_pb
from berth.environment.v1 import environment_service_pb2_grpc as env_grpc
from gateway.keys import create_key

RUNS = int(__import__("os").environ.get("BENCH_TURN_RUNS", "50"))
WARMUP = 3


async def _client(base_url: str, key: str, runs: int, warmup: int) -> dict[str, object]:
    """The client side: creates the session, opens its event stream, runs
    the turns; returns the samples (ms) and the IDs the baseline needs."""
    headers = {"Authorization": f"Bearer {key}", "OpenAI-Beta": "agents=v1"}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=60) as http:
        created = await create_session(http)
        session_id, environment_id = created["id"], created["environment"]["id"]
        async with turn_stream(http, session_id) as events:
            # The first turn provisions the sandbox; the rest are warm. The
            # idle after each turn is not timed: the next turn starts on an
            # idle session.
            for _ in range(warmup):
                await events.turn()
                await events.until("agent.session.idle")
            samples: list[float] = []
            for _ in range(runs):
                t0 = time.perf_counter()
                await events.turn()
                samples.append((time.perf_counter() - t0) * 1000)
                await events.until("agent.session.idle")
        statuses = (await http.get(f"/agents/sessions/{session_id}/turns", params={"limit": 100})).json()["data"]
        if any(t["status"] != "completed" for t in statuses):
            raise RuntimeError(f"a benchmark turn did not complete: {json.dumps(statuses[:3])}")
    return {"samples": samples, "session_id": session_id, "environment_id": environment_id}


async def run(tmp: Path) -> list[Result]:
    async with running_stack(tmp / "berth") as stack:
        record, _ = await create_key(stack.gateway.database, "bench", ["tasks:read"])
        org = (("x-berth-org", record.org_id),)
        report = await run_client("bench.bench_turn", stack.base_url, stack.key, str(RUNS), str(WARMUP))
        samples = [float(v) for v in report["samples"]]
        session_id, environment_id = str(report["session_id"]), str(report["environment_id"])

        channel = internal_channel(stack.settings.environment_addr, "session")
        stub = env_grpc.EnvironmentServiceStub(channel)
        try:

            async def direct_exec() -> None:
                call = stub.ExecCommand(
                    env_pb.ExecCommandRequest(environment_id=environment_id, session_id=session_id, shell="true"),
                    metadata=org,
                    timeout=30,
                )
                async for message_ in call:
                    if message_.WhichOneof("event") == "exit" and message_.exit.exit_code != 0:
                        raise RuntimeError("true failed")

            base = await measure(direct_exec, runs=RUNS, warmup=WARMUP)
        finally:
            await channel.close()
    return [
        summarize(
            "turn `$ true`, POST -> turn.completed (warm)", samples, "Environment ExecCommand(true)", base, "p50 < 30 ms"
        )
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description="the benchmark's HTTP client (run by the benchmark itself)")
    parser.add_argument("--client", nargs=4, metavar=("BASE_URL", "KEY", "RUNS", "WARMUP"), required=True)
    args = parser.parse_args()
    base_url, key, runs, warmup = args.client
    print(json.dumps(asyncio.run(_client(base_url, key, int(runs), int(warmup)))))


if __name__ == "__main__":
    main()
