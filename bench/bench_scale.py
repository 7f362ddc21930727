"""Throughput under load: ``berth serve`` (as a user runs it, in processes of
its own) with 1, 20, 100 and 200 concurrent sessions, each holding a live SSE
stream and running scripted ``$ true`` turns back to back for a window of
``BENCH_SCALE_SECONDS`` (default 10). The client is one process of its own
(``bench.scale_client``).

Baseline in the same run: the same loads on ``berth serve`` with
``BERTH_SERVE_PROCESSES=false``, every service in one process and one event
loop (how ``berth serve`` ran before). Targets (issue 14): at 100 sessions
at least 150 turns/s with p95 under 1 s; 200 sessions no lower than 100;
throughput at 100 over throughput at 1 is the scaling ratio.

The multi-process layout also runs on PostgreSQL, a scratch database per
service on ``BERTH_BENCH_POSTGRES_URL`` (``bench.postgres``), printed beside
the same layout on SQLite from the same run ("the multi-process PostgreSQL
deployment scales the same way"); ``BENCH_SCALE_POSTGRES=0`` skips it.

Also here: cross-replica event and cancel latency (``bench replicas``), and
the rows of ``bench sandboxes`` (idle PSS per sandbox, creation rate, warm
pool) where that benchmark exists."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import re
import signal
import socket
import statistics
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

from bench.postgres import reachable, scratch_database
from bench.runner import Result, percentile, run_client
from services.core.settings import ServiceName

LOADS = [int(n) for n in os.environ.get("BENCH_SCALE_LOADS", "1,20,100,200").split(",")]
SECONDS = float(os.environ.get("BENCH_SCALE_SECONDS", "10"))
# The multi-process layout again on PostgreSQL (``bench.postgres``), unless 0.
POSTGRES = os.environ.get("BENCH_SCALE_POSTGRES", "1") != "0"
_KEY = re.compile(r"sk-berth-[A-Za-z0-9_-]+")
_START_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class Load:
    sessions: int
    turns_per_s: float
    p50_ms: float
    p95_ms: float
    repeats: int
    gaps: int
    failed: bool = False

    def ratio_to(self, other: Load) -> float:
        return self.turns_per_s / other.turns_per_s if other.turns_per_s else float("nan")

    def trouble(self) -> str:
        """Events seen twice or missed, and a failed load, for its row."""
        out = "" if self.repeats == self.gaps == 0 else f"  ({self.repeats} repeated, {self.gaps} gaps!)"
        return out + ("  (failed: see above)" if self.failed else "")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@asynccontextmanager
async def berth_serve(
    data_dir: Path, *, processes: bool, env_extra: Mapping[str, str] | None = None
) -> AsyncIterator[tuple[str, str, int]]:
    """``berth serve`` on a fresh data directory (and ``env_extra`` in its
    environment); yields (base URL, the dev key it printed, its PID)."""
    port = _free_port()
    env = {
        **os.environ,
        **(env_extra or {}),
        "BERTH_DATA_DIR": str(data_dir),
        "BERTH_GATEWAY_PORT": str(port),
        "BERTH_LOG_LEVEL": "ERROR",
        "BERTH_SANDBOX_IDLE_PAUSE_S": "0",
        "BERTH_SERVE_PROCESSES": "true" if processes else "false",
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "serve", env=env, stdout=asyncio.subprocess.PIPE, start_new_session=True
    )
    assert process.stdout is not None
    try:
        key = ""
        async with asyncio.timeout(_START_TIMEOUT_S):
            while not key:
                line = (await process.stdout.readline()).decode()
                if not line:
                    raise RuntimeError(f"berth serve exited ({await process.wait()})")
                if found := _KEY.search(line):
                    key = found.group(0)
        # Its later output must not fill the pipe and block it.
        drain = asyncio.create_task(process.stdout.read())
        yield f"http://127.0.0.1:{port}/v1", key, process.pid
        drain.cancel()
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), 60)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
        await _destroy_sandboxes(data_dir)


async def _destroy_sandboxes(data_dir: Path) -> None:
    from services.sandbox.backends.local import LocalBackend

    backend = LocalBackend(data_dir, isolation="none")
    for handle in await backend.adopt():
        await backend.destroy(handle)


@asynccontextmanager
async def _postgres_urls() -> AsyncIterator[dict[str, str]]:
    """A scratch PostgreSQL database per service, as ``berth serve``'s
    ``BERTH_<SERVICE>_DATABASE_URL`` variables."""
    async with contextlib.AsyncExitStack() as stack:
        urls = {}
        for service in get_args(ServiceName):
            url = await stack.enter_async_context(scratch_database(f"berth_bench_scale_{service}"))
            urls[f"BERTH_{service.upper()}_DATABASE_URL"] = url
        yield urls


async def measure_loads(
    data_dir: Path, *, processes: bool, loads: list[int], seconds: float, postgres: bool = False
) -> list[Load]:
    out: list[Load] = []
    for sessions in loads:
        # A fresh server per load: sandboxes of an earlier load do not weigh on this one.
        name = f"{'pg' if postgres else 'procs' if processes else 'single'}-{sessions}"
        try:
            async with contextlib.AsyncExitStack() as stack:
                env = await stack.enter_async_context(_postgres_urls()) if postgres else {}
                url, key, _ = await stack.enter_async_context(berth_serve(data_dir / name, processes=processes, env_extra=env))
                report = await run_client("bench.scale_client", url, key, str(sessions), str(seconds))
        except Exception as exc:  # an overloaded server fails one load, not the table
            print(f"scale: {name} failed: {type(exc).__name__}: {exc}", flush=True)
            out.append(Load(sessions, float("nan"), float("nan"), float("nan"), 0, 0, failed=True))
            continue
        latencies = [float(v) for v in report["latencies_ms"]]
        out.append(
            Load(
                sessions=sessions,
                turns_per_s=report["turns"] / report["seconds"],
                p50_ms=statistics.median(latencies) if latencies else float("nan"),
                p95_ms=percentile(latencies, 0.95),
                repeats=int(report["repeats"]),
                gaps=int(report["gaps"]),
            )
        )
        print(f"scale: {name}: {out[-1]}", flush=True)
    return out


_TARGETS = {100: ">= 150 turns/s, p95 < 1000 ms", 200: ">= the rate at 100"}


def print_scale(measured: list[Load], baseline: list[Load]) -> None:
    header = (
        f"{'scale: sessions':<18} {'turns/s':>9} {'p50 ms':>9} {'p95 ms':>9}   "
        f"{'single-process turns/s':>22} {'p50 ms':>9} {'p95 ms':>9} {'ratio':>6}  target"
    )
    print(header)
    print("-" * len(header))
    for m, b in zip(measured, baseline, strict=True):
        print(
            f"{m.sessions:<18} {m.turns_per_s:>9.1f} {m.p50_ms:>9.1f} {m.p95_ms:>9.1f}   "
            f"{b.turns_per_s:>22.1f} {b.p50_ms:>9.1f} {b.p95_ms:>9.1f} {m.ratio_to(b):>6.2f}  "
            f"{_TARGETS.get(m.sessions, '')}{m.trouble()}"
        )
    base = _scaling(baseline)
    for (label, ratio, target), (_, base_ratio, _) in zip(_scaling(measured), base, strict=True):
        issue = " (issue: 0.86)" if label.endswith("at 1") else ""
        print(f"{'scaling: ' + label:<40} {ratio:>6.2f}   single-process {base_ratio:>6.2f}   {target}{issue}")


def print_postgres(postgres: list[Load], sqlite: list[Load]) -> None:
    """The multi-process layout on PostgreSQL (a database per service),
    beside the same layout on SQLite from the same run."""
    header = (
        f"{'scale on PostgreSQL: sessions':<30} {'turns/s':>9} {'p50 ms':>9} {'p95 ms':>9}   "
        f"{'on SQLite turns/s':>17} {'ratio':>6}"
    )
    print(header)
    print("-" * len(header))
    for p, m in zip(postgres, sqlite, strict=True):
        print(
            f"{p.sessions:<30} {p.turns_per_s:>9.1f} {p.p50_ms:>9.1f} {p.p95_ms:>9.1f}   "
            f"{m.turns_per_s:>17.1f} {p.ratio_to(m):>6.2f}{p.trouble()}"
        )
    for label, ratio, target in _scaling(postgres):
        print(f"{'scaling on PostgreSQL: ' + label:<48} {ratio:>6.2f}   {target}")


def _scaling(loads: list[Load]) -> list[tuple[str, float, str]]:
    """The scaling ratios the issue asks for, of the loads measured: (what, ratio, target)."""
    rates = {load.sessions: load.turns_per_s for load in loads}
    return [
        (f"rate at {high} / rate at {low}", rates[high] / rates[low], target)
        for high, low, target in ((100, 1, "target > 1"), (200, 100, "target >= 1"))
        if high in rates and low in rates
    ]


# Benchmarks whose rows ``bench scale`` adds to its table: cross-replica
# latency, and (where the module exists) bench_sandboxes' idle PSS per
# sandbox, creation rate and warm pool.
ROW_BENCHMARKS = ["replicas", "sandboxes"]


async def run(tmp: Path) -> list[Result]:
    measured: list[Load] = []
    baseline: list[Load] = []
    postgres: list[Load] = []
    unreachable = await reachable() if POSTGRES else "BENCH_SCALE_POSTGRES=0"
    # Interleaved, so that every layout sees the same machine load.
    for sessions in LOADS:
        measured += await measure_loads(tmp / "m", processes=True, loads=[sessions], seconds=SECONDS)
        baseline += await measure_loads(tmp / "b", processes=False, loads=[sessions], seconds=SECONDS)
        if unreachable is None:
            postgres += await measure_loads(tmp / "p", processes=True, loads=[sessions], seconds=SECONDS, postgres=True)
    print_scale(measured, baseline)
    print()
    if unreachable is None:
        print_postgres(postgres, measured)
    else:
        print(f"scale on PostgreSQL: skipped ({unreachable})")
    print()
    rows: list[Result] = []
    for name in ROW_BENCHMARKS:
        try:
            module = importlib.import_module(f"bench.bench_{name}")
        except ModuleNotFoundError:
            print(f"(bench {name} is not in this tree: its rows are missing)")
            continue
        rows.extend(await module.run(tmp / name))
    return rows


__all__ = ["run", "berth_serve", "measure_loads"]
