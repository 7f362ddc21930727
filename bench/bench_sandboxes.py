"""Density of local sandboxes (isolated, network ``enabled``, the default):
what an idle one costs, how fast many are made, how fast an idle, paused or
pooled one answers, and warm exec against raw fork+exec.

    python -m bench sandboxes                 # 200 sandboxes, concurrency 32
    BERTH_BENCH_SANDBOXES=50 python -m bench sandboxes

Memory is PSS (``/proc/<pid>/smaps_rollup``) summed over every process that
exists per sandbox: the bubblewrap processes, sandboxd and slirp4netns.
An idle sandbox's daemon is dormant (``sandboxd/dormant.py``); the same
sandboxes measured just after creation, awake, are the baseline.
``sandbox_figures`` returns the rows (``bench scale`` prints them too).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from bench.bench_exec import ORG, raw_spawn, via_service
from bench.runner import Result, measure, percentile
from bench.stack import INTERNAL_TOKEN, internal_channel
from berth.common.v1 import common_pb2
from berth.sandbox.v1 import sandbox_service_pb2 as pb
from berth.sandbox.v1 import sandbox_service_pb2_grpc
from services.core.settings import Settings
from services.sandbox.backends.base import BackendHandle, SandboxSpec
from services.sandbox.backends.local import LocalBackend, _process_tree
from services.sandbox.daemon_client import DaemonClient, probe
from services.sandbox.server import build_backend, start_sandbox_service

__all__ = ["Figure", "sandbox_figures", "print_figures", "run", "wait_pool_ready"]

_DORMANT_AFTER_S = 1.0
_LATENCY_SAMPLES = 20
_CLAIM_SAMPLES = 15
_MIB = 1024 * 1024


@dataclass(frozen=True)
class Figure:
    name: str
    value: float
    unit: str
    target: str
    met: bool | None
    baseline: str = ""

    def line(self) -> str:
        verdict = {True: "met", False: "MISSED", None: ""}[self.met]
        return f"{self.name:<52} {self.value:>10.2f} {self.unit:<6} {self.target:<16} {verdict:<7} {self.baseline}"


def _pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _sandbox_pids(handle: BackendHandle) -> list[int]:
    pids = _process_tree(int(handle.private["pid"]))
    user_network = handle.private.get("user_network")
    if isinstance(user_network, dict) and isinstance(user_network.get("pid"), int):
        pids.append(int(user_network["pid"]))
    return pids


def _pss_per_sandbox_mib(handles: list[BackendHandle]) -> float:
    total = sum(_pss_kib(pid) for handle in handles for pid in _sandbox_pids(handle))
    return total / 1024 / len(handles)


def _dormant(handle: BackendHandle) -> bool:
    for pid in _process_tree(int(handle.private["pid"])):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                argv = cmdline.read().split(b"\0")
        except OSError:
            continue
        if (b"--dormant" in argv or b"--start-dormant" in argv) and b"python" in argv[0]:
            return True
    return False


async def _wait_dormant(handles: list[BackendHandle], timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        dormant = sum(1 for handle in handles if _dormant(handle))
        if dormant == len(handles) or time.monotonic() >= deadline:
            return dormant
        await asyncio.sleep(0.2)


async def _first_command_ms(client: DaemonClient) -> float:
    t0 = time.perf_counter()
    async for _ in client.exec(argv=["true"]):
        pass
    return (time.perf_counter() - t0) * 1000


async def _create_all(backend: LocalBackend, count: int, concurrency: int) -> tuple[list[BackendHandle], float]:
    gate = asyncio.Semaphore(concurrency)

    async def one(index: int) -> BackendHandle:
        async with gate:
            return await backend.create(SandboxSpec(sandbox_id=f"sbx_density_{index}", network="enabled"))

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(count)), return_exceptions=True)
    elapsed = time.perf_counter() - t0
    handles = [r for r in results if isinstance(r, BackendHandle)]
    failures = [r for r in results if not isinstance(r, BackendHandle)]
    if failures:
        await asyncio.gather(*(backend.destroy(h) for h in handles), return_exceptions=True)
        raise RuntimeError(f"{len(failures)} of {count} creates failed, first: {failures[0]!r}")
    return handles, elapsed


async def _density(tmp: Path, count: int, concurrency: int) -> list[Figure]:
    settings = Settings(data_dir=tmp, sandbox_dormant_after_s=_DORMANT_AFTER_S)
    backend, _, _ = build_backend(settings)
    assert isinstance(backend, LocalBackend)
    await backend.start()
    handles: list[BackendHandle] = []
    clients: list[DaemonClient] = []
    try:
        handles, elapsed = await _create_all(backend, count, concurrency)
        samples = max(1, min(_LATENCY_SAMPLES, count // 2))
        # A live connection each, as the Sandbox service holds; each
        # connection wakes its daemon, so a few at a time.
        clients = [DaemonClient(backend.socket_path(h), connect_timeout_s=60, request_timeout_s=60) for h in handles]
        gate = asyncio.Semaphore(4)

        async def connect(client: DaemonClient) -> None:
            async with gate:
                await client.connect()

        await asyncio.gather(*(connect(c) for c in clients))
        # Awake: each sample woken, then measured before it can sleep again.
        awake: list[float] = []
        awake_mib: list[float] = []
        for handle, client in zip(handles[:samples], clients[:samples]):
            await _first_command_ms(client)
            awake.append(await _first_command_ms(client))
            awake_mib.append(_pss_per_sandbox_mib([handle]))
        awake_pss = statistics.mean(awake_mib)
        dormant = await _wait_dormant(handles, 60 + count * 0.2)
        idle_pss = _pss_per_sandbox_mib(handles)
        idle = [await _first_command_ms(client) for client in clients[:samples]]
        # Paused: dormant again, then frozen; the command resumes it first.
        sample = list(zip(handles, clients))[samples : 2 * samples]
        await _wait_dormant([h for h, _ in sample], 30)
        paused: list[float] = []
        for handle, client in sample:
            await backend.pause(handle)
            t0 = time.perf_counter()
            await backend.resume(handle)
            await _first_command_ms(client)
            paused.append((time.perf_counter() - t0) * 1000)
    finally:
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
        await asyncio.gather(*(backend.destroy(h) for h in handles), return_exceptions=True)
        await backend.close()
    awake_p50 = statistics.median(awake)
    return [
        Figure("idle sandbox PSS (daemon dormant)", idle_pss, "MiB", "<= 8 MiB", idle_pss <= 8,
               f"awake {awake_pss:.2f} MiB; {dormant}/{count} dormant"),
        Figure("1,000 idle sandboxes, PSS extrapolated", idle_pss * 1000 / 1024, "GiB", "<= 8 GiB", idle_pss * 1000 / 1024 <= 8,
               f"awake {awake_pss * 1000 / 1024:.2f} GiB"),
        Figure(f"create {count} sandboxes at concurrency {concurrency}", elapsed, "s",
               "<= 5 s" if count == 200 and concurrency == 32 else "(200 @ 32: <= 5 s)",
               elapsed <= 5 if count == 200 and concurrency == 32 else None, f"{elapsed / count * 1000:.0f} ms each"),
        Figure("next command of an idle (dormant) sandbox, p50", statistics.median(idle), "ms", "< 50 ms",
               statistics.median(idle) < 50, f"p95 {percentile(idle, 0.95):.1f}; awake p50 {awake_p50:.2f}"),
        Figure("next command of a paused sandbox, p50", statistics.median(paused), "ms", "< 50 ms",
               statistics.median(paused) < 50, f"p95 {percentile(paused, 0.95):.1f} (resume + exec)"),
    ]  # fmt: skip


_ENABLED = common_pb2.NetworkPolicy(access=common_pb2.NETWORK_ACCESS_ENABLED)


async def wait_pool_ready(pool_dir: Path, timeout_s: float) -> None:
    """Until a pooled sandbox's daemon answers (the service's pool is not
    reachable from here; its slot directories are)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        slots = list(pool_dir.iterdir()) if pool_dir.is_dir() else []
        for slot in slots:
            if await probe(str(slot / "run" / "berth" / "sandboxd.sock")) is None:
                return
        await asyncio.sleep(0.05)


async def _create_then_exec_ms(tmp: Path, pool_size: int) -> list[float]:
    """CreateSandbox then Exec(true) through the Sandbox service, each on a
    new sandbox; with a pool, the pool is refilled before every sample."""
    settings = Settings(data_dir=tmp, sandbox_pool_size=pool_size, internal_token=INTERNAL_TOKEN)
    service = await start_sandbox_service(settings, address="127.0.0.1:0")
    channel = internal_channel(service.address, "environment")
    stub = sandbox_service_pb2_grpc.SandboxServiceStub(channel)
    samples: list[float] = []
    created: list[str] = []
    try:
        for index in range(_CLAIM_SAMPLES + 1):
            if pool_size and index:
                await wait_pool_ready(tmp / "pool", 60)
            sandbox_id = f"sbx_claim_{index}"
            t0 = time.perf_counter()
            await stub.CreateSandbox(pb.CreateSandboxRequest(sandbox_id=sandbox_id, network=_ENABLED), metadata=ORG)
            created.append(sandbox_id)
            async for _ in stub.Exec(pb.ExecRequest(sandbox_id=sandbox_id, argv=["true"]), metadata=ORG):
                pass
            if index:  # the first one fills the pool's key
                samples.append((time.perf_counter() - t0) * 1000)
    finally:
        for sandbox_id in created:
            await stub.DestroySandbox(pb.DestroySandboxRequest(sandbox_id=sandbox_id), metadata=ORG)
        await channel.close()
        await service.stop(0.2)
    return samples


async def _pool_claim(tmp: Path) -> list[Figure]:
    pooled = await _create_then_exec_ms(tmp / "pooled", pool_size=1)
    cold = await _create_then_exec_ms(tmp / "cold", pool_size=0)
    p50 = statistics.median(pooled)
    return [
        Figure("CreateSandbox + first Exec, warm pool, p50", p50, "ms", "< 40 ms", p50 < 40,
               f"p95 {percentile(pooled, 0.95):.1f}; without pool p50 {statistics.median(cold):.1f}"),
    ]  # fmt: skip


async def _warm_exec(tmp: Path) -> list[Figure]:
    true = "/bin/true" if os.path.exists("/bin/true") else "true"
    service_ms = await via_service(tmp)
    fork_ms = await measure(lambda: raw_spawn([true]), runs=300)
    ratio = statistics.median(service_ms) / statistics.median(fork_ms)
    return [
        Figure("warm Exec(true) / raw fork+exec, p50", ratio, "x", "< 2x", ratio < 2,
               f"{statistics.median(service_ms):.2f} ms vs {statistics.median(fork_ms):.2f} ms"),
    ]  # fmt: skip


async def sandbox_figures(tmp: Path, *, count: int = 200, concurrency: int = 32) -> list[Figure]:
    """Every figure of this benchmark, each with its target."""
    return [
        *await _density(tmp / "density", count, concurrency),
        *await _pool_claim(tmp / "pool"),
        *await _warm_exec(tmp / "exec"),
    ]


def print_figures(figures: list[Figure]) -> None:
    print(f"{'sandboxes':<52} {'value':>10} {'unit':<6} {'target':<16} {'':<7} baseline / detail")
    for figure in figures:
        print(figure.line())


async def run(tmp: Path) -> list[Result]:
    count = int(os.environ.get("BERTH_BENCH_SANDBOXES", "200"))
    print_figures(await sandbox_figures(tmp, count=count))
    return []
