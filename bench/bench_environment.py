"""Cold path of an inline environment: POST a session with an inline
environment, then its first file operation (which provisions the sandbox),
over HTTP through the gateway, with the default isolation (user, network
and mount namespaces, cgroup limits, disk quota, seccomp; network
``disabled`` and ``enabled``) and without it (``BERTH_SANDBOX_ISOLATION=none``).
Baseline: starting a raw bubblewrap sandbox running ``python3 -c pass`` in
the same run (the floor of any cold start). Target: p50 under 150 ms on the
local backend with isolation on.

With the local warm pool (``BERTH_SANDBOX_POOL_SIZE=1``, isolated, network
``enabled``): POST a session, then its first command, ``true`` through the
Environment service's ExecCommand (what the harness calls), until its exit
status arrives; the pool is refilled, untimed, before every sample. Baseline
in the same run: the same steps with no pool. Target (issue 14): p50 under
40 ms."""

from __future__ import annotations

import asyncio
import base64
import shutil
import time
from pathlib import Path

import httpx

from bench.bench_sandboxes import wait_pool_ready
from bench.runner import Result, summarize
from bench.stack import internal_channel, running_stack, session_then_first_command
from berth.environment.v1 import environment_service_pb2_grpc as env_grpc
from gateway.keys import create_key

RUNS = 30


async def _raw_bwrap_python() -> None:
    argv = ["bwrap", "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
            "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev", "--unshare-pid", "python3", "-c", "pass"]
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    await proc.wait()


async def _cold_samples(data_dir: Path, network: str, **overrides: object) -> list[float]:
    async with running_stack(data_dir, **overrides) as stack, httpx.AsyncClient(base_url=stack.base_url, headers=stack.headers, timeout=60) as http:
        data = base64.b64encode(b"hello").decode()
        environment = {"type": "openai_hosted", "network": {"access": network}}

        async def cold() -> None:
            resp = await http.post("/agents/sessions", json={"agent": {"model": "scripted"}, "environment": environment})
            resp.raise_for_status()
            env_id = resp.json()["environment"]["id"]
            resp = await http.post(f"/agents/environments/{env_id}/files", json={"type": "inline", "path": "/workspace/a.txt", "data": data})
            resp.raise_for_status()

        await cold()
        samples = []
        for _ in range(RUNS):
            t0 = time.perf_counter()
            await cold()
            samples.append((time.perf_counter() - t0) * 1000)
        return samples


async def _first_command_samples(data_dir: Path, *, pool_size: int) -> list[float]:
    """Session create, then its first command; one new session per sample."""
    async with running_stack(data_dir, sandbox_pool_size=pool_size) as stack, httpx.AsyncClient(
        base_url=stack.base_url, headers=stack.headers, timeout=60
    ) as http:
        record, _ = await create_key(stack.gateway.database, "bench", ["tasks:read"])
        org = (("x-berth-org", record.org_id),)
        channel = internal_channel(stack.settings.environment_addr, "session")
        environments = env_grpc.EnvironmentServiceStub(channel)
        environment: dict[str, object] = {"type": "openai_hosted", "network": {"access": "enabled"}}
        samples: list[float] = []
        try:
            for index in range(RUNS + 1):  # the first one fills the pool's key
                if pool_size and index:
                    await wait_pool_ready(data_dir / "pool", 60)
                t0 = time.perf_counter()
                session_id = await session_then_first_command(http, environments, org, environment)
                if index:
                    samples.append((time.perf_counter() - t0) * 1000)
                # Not timed: deleting the session destroys its environment's sandbox.
                (await http.delete(f"/agents/sessions/{session_id}")).raise_for_status()
        finally:
            await channel.close()
        return samples


async def run(tmp: Path) -> list[Result]:
    base = []
    if shutil.which("bwrap"):
        for _ in range(RUNS):
            t0 = time.perf_counter()
            await _raw_bwrap_python()
            base.append((time.perf_counter() - t0) * 1000)
    base = base or [float("nan")]
    results = []
    for label, network, overrides in (
        ("isolated, network disabled", "disabled", {}),
        ("isolated, network enabled", "enabled", {}),
        ("no isolation", "disabled", {"sandbox_isolation": "none"}),
    ):
        samples = await _cold_samples(tmp / label.replace(" ", "-").replace(",", ""), network, **overrides)
        target = "p50 < 150 ms" if label.startswith("isolated") else ""
        results.append(summarize(f"session + first file op, cold ({label})", samples, "raw bwrap python3 -c pass", base, target))
    if shutil.which("bwrap"):
        pooled = await _first_command_samples(tmp / "pooled", pool_size=1)
        unpooled = await _first_command_samples(tmp / "unpooled", pool_size=0)
        results.append(summarize("session + first command, warm pool (local)", pooled, "the same, no pool", unpooled, "p50 < 40 ms"))
    return results
