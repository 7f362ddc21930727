"""Warm exec of ``true`` through SandboxService.Exec (gRPC -> service ->
sandboxd in a running bubblewrap sandbox), against a raw fork+exec of
``true`` and a fresh raw ``bwrap ... true`` measured in the same run.
Target: p50 under 2x raw fork+exec."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import grpc

from bench.runner import Result, measure, summarize
from berth.sandbox.v1 import sandbox_service_pb2 as pb, sandbox_service_pb2_grpc
from services.core.settings import Settings
from services.sandbox.server import start_sandbox_service

ORG = (("x-berth-org", "bench"),)
RUNS = 300


async def _raw_spawn(argv: list[str]) -> None:
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    await proc.wait()


async def run(tmp: Path) -> list[Result]:
    settings = Settings(data_dir=tmp / "berth", sandbox_idle_pause_s=0)
    service = await start_sandbox_service(settings, address="127.0.0.1:0")
    channel = grpc.aio.insecure_channel(service.address)
    stub = sandbox_service_pb2_grpc.SandboxServiceStub(channel)
    try:
        await stub.CreateSandbox(pb.CreateSandboxRequest(sandbox_id="sbx_bench"), metadata=ORG)

        async def via_service() -> None:
            async for _ in stub.Exec(pb.ExecRequest(sandbox_id="sbx_bench", argv=["true"]), metadata=ORG):
                pass

        true = shutil.which("true") or "/bin/true"
        service_ms = await measure(via_service, runs=RUNS)
        fork_ms = await measure(lambda: _raw_spawn([true]), runs=RUNS)
        results = [summarize("sandbox Exec(true), warm", service_ms, "raw fork+exec true", fork_ms, "p50 < 2x")]
        if shutil.which("bwrap"):
            bwrap = ["bwrap", "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
                     "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev", "--unshare-pid", true]
            bwrap_ms = await measure(lambda: _raw_spawn(bwrap), runs=100)
            results.append(summarize("sandbox Exec(true), warm", service_ms, "raw bwrap true (fresh)", bwrap_ms))
        return results
    finally:
        try:
            await stub.DestroySandbox(pb.DestroySandboxRequest(sandbox_id="sbx_bench"), metadata=ORG)
        finally:
            await channel.close()
            await service.stop(0.2)
