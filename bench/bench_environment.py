"""Cold path of an inline environment: POST a session with an inline
environment, then its first file operation (which provisions the sandbox),
over HTTP through the gateway. Baseline: starting a raw bubblewrap sandbox
running ``python3 -c pass`` in the same run (the floor of any cold start).
Target: p50 under 150 ms on the local backend."""

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


async def run(tmp: Path) -> list[Result]:
    async with running_stack(tmp / "berth") as stack, httpx.AsyncClient(base_url=stack.base_url, headers=stack.headers, timeout=60) as http:
        data = base64.b64encode(b"hello").decode()

        async def cold() -> None:
            resp = await http.post("/agents/sessions", json={"agent": {"model": "scripted"}, "environment": {"type": "openai_hosted"}})
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
        base = []
        if shutil.which("bwrap"):
            for _ in range(RUNS):
                t0 = time.perf_counter()
                await _raw_bwrap_python()
                base.append((time.perf_counter() - t0) * 1000)
        return [summarize("session create + first file op (cold)", samples, "raw bwrap python3 -c pass", base or [float("nan")], "p50 < 150 ms")]
