"""Cold path of an inline environment: POST a session with an inline
environment, then its first file operation (which provisions the sandbox),
over HTTP through the gateway, with the default isolation (user, network
and mount namespaces, cgroup limits, disk quota, seccomp; network
``disabled`` and ``enabled``) and without it (``BERTH_SANDBOX_ISOLATION=none``).
Baseline: starting a raw bubblewrap sandbox running ``python3 -c pass`` in
the same run (the floor of any cold start). Target: p50 under 150 ms on the
local backend with isolation on."""

from __future__ import annotations

import asyncio
import base64
import shutil
import time
from pathlib import Path

import httpx

from bench.runner import Result, summarize
from bench.stack import running_stack

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
    return results
