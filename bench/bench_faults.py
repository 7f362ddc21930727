"""What a client sees when each service is killed: the four services as
separate processes on PostgreSQL under a bounded load (sessions x turns of
``$ echo N >> /workspace/log``, a live SSE consumer per session), each one
killed with SIGKILL in turn and restarted at once, while one more client
reads a session and its environment's files every 0.1 s. Prints, per kill,
the client-visible error rate (5xx and refused connections among the
clients' requests from the kill to the next one) and the recovery time (from
the kill to the last such error), and the turns that failed or stuck
(target: none).

    python -m bench faults

Not in the default selection: it needs PostgreSQL (``BERTH_BENCH_POSTGRES_URL``,
default ``postgresql://postgres@127.0.0.1:5432/test``, whose server gets a
scratch database) and bubblewrap. The load and the process stack are the
fault-injection test's (``tests/e2e/fault_stack.py``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from bench.postgres import scratch_database
from bench.runner import Result
from bench.stack import INTERNAL_TOKEN

__all__ = ["run"]

_ROOT = Path(__file__).resolve().parents[1]
SESSIONS = 8
TURNS = 6


async def run(tmp: Path) -> list[Result]:
    sys.path.insert(0, str(_ROOT / "tests" / "e2e"))
    from fault_stack import FaultLoad, running_processes  # type: ignore[import-not-found]

    os.environ.setdefault("BERTH_INTERNAL_TOKEN", INTERNAL_TOKEN.get_secret_value())
    try:
        async with scratch_database("berth_bench_faults") as url, running_processes(tmp / "berth", url) as stack:
            load = FaultLoad(stack, sessions=SESSIONS, turns=TURNS, kill_order=("environment", "sandbox", "session", "gateway"))
            report = await load.run()
        print(f"faults: {SESSIONS} sessions x {TURNS} turns, each service killed once (SIGKILL) and restarted")
        print(f"{'killed':<12} {'client errors':>14} {'error rate':>11} {'recovery s':>11} {'restart s':>10}")
        for kill in report.kills:
            restart = kill.ready_at - kill.killed_at
            print(
                f"{kill.service:<12} {f'{kill.errors}/{kill.requests}':>14} {kill.error_rate:>10.0%} "
                f"{kill.recovery_s:>11.1f} {restart:>10.1f}"
            )
        total = sum(len(turns) for turns in report.turns.values())
        print(
            f"turns: {total} run, {len(report.failed)} failed, {len(report.stuck)} stuck (target: 0 failed); "
            f"SSE reconnects {sum(f.reconnects for f in report.followers)}, "
            f"gaps {sum(len(f.gaps) for f in report.followers)}, duplicates {sum(len(f.duplicates) for f in report.followers)}"
        )
        for turn_id, why in report.failed:
            print(f"  failed {turn_id}: {why}")
    finally:
        from services.sandbox.backends.local import LocalBackend

        backend = LocalBackend(tmp / "berth", isolation="none")
        for handle in await backend.adopt():
            await backend.destroy(handle)
    return []
