"""Shared benchmark machinery: timing, percentiles and the result table.

Every benchmark measures its subject and a baseline in the same run and
reports the ratio, because these machines are noisy and absolute numbers are
not comparable between runs.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Result", "measure", "measure_concurrent", "percentile", "print_table", "run_client"]


@dataclass(frozen=True)
class Result:
    name: str
    p50_ms: float
    p95_ms: float
    baseline: str
    baseline_p50_ms: float
    baseline_p95_ms: float
    target: str = ""

    @property
    def ratio(self) -> float:
        return self.p50_ms / self.baseline_p50_ms if self.baseline_p50_ms else float("nan")


def percentile(samples: list[float], q: float) -> float:
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    idx = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[idx]


async def run_client(module: str, *args: str) -> Any:
    """Runs ``python -m <module> --client <args>`` (a benchmark's client in a
    process of its own, so its CPU is not billed to the servers in this one)
    and returns the JSON it prints."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", module, "--client", *args, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"the benchmark client {module} failed ({process.returncode})")
    return json.loads(out)


async def measure(fn: Callable[[], Awaitable[object]], *, runs: int, warmup: int = 3) -> list[float]:
    """Sequential latencies in milliseconds."""
    for _ in range(warmup):
        await fn()
    out: list[float] = []
    for _ in range(runs):
        t0 = time.perf_counter()
        await fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


async def measure_concurrent(fn: Callable[[], Awaitable[object]], *, total: int, concurrency: int, warmup: int = 5) -> list[float]:
    """Latencies in milliseconds of ``total`` calls issued by ``concurrency`` workers."""
    for _ in range(warmup):
        await fn()
    out: list[float] = []
    remaining = total

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            t0 = time.perf_counter()
            await fn()
            out.append((time.perf_counter() - t0) * 1000)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


def summarize(name: str, samples: list[float], baseline: str, base_samples: list[float], target: str = "") -> Result:
    return Result(
        name=name,
        p50_ms=statistics.median(samples),
        p95_ms=percentile(samples, 0.95),
        baseline=baseline,
        baseline_p50_ms=statistics.median(base_samples),
        baseline_p95_ms=percentile(base_samples, 0.95),
        target=target,
    )


def print_table(results: list[Result]) -> None:
    header = f"{'benchmark':<44} {'p50 ms':>9} {'p95 ms':>9}  {'baseline':<32} {'p50 ms':>9} {'p95 ms':>9} {'ratio':>7}  target"
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r.name:<44} {r.p50_ms:>9.3f} {r.p95_ms:>9.3f}  {r.baseline:<32} {r.baseline_p50_ms:>9.3f} "
            f"{r.baseline_p95_ms:>9.3f} {r.ratio:>7.2f}  {r.target}"
        )


__all__ += ["summarize"]
