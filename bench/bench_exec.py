"""Warm exec of ``true`` through SandboxService.Exec (gRPC -> service ->
sandboxd in a running bubblewrap sandbox), against a raw fork+exec of
``true`` and a fresh raw ``bwrap ... true`` measured in the same run, with
the default isolation and without it (``BERTH_SANDBOX_ISOLATION=none``).
Target: p50 under 2x raw fork+exec with isolation on.

The same run also execs ``true`` straight over sandboxd's socket (no gRPC,
no service) in a sandbox of the same isolation, so the table splits the
ratio into the exec path itself (sandboxd -> fork+exec) and what the gRPC
hop adds on top of it."""

from __future__ import annotations

import asyncio
import shutil
from dataclasses import dataclass
from pathlib import Path


from bench.runner import Result, measure, summarize
from bench.stack import INTERNAL_TOKEN, internal_channel
from berth.sandbox.v1 import sandbox_service_pb2 as pb, sandbox_service_pb2_grpc
from services.core.settings import Settings
from services.sandbox.backends.base import SandboxSpec
from services.sandbox.daemon_client import DaemonClient
from services.sandbox.server import build_backend, start_sandbox_service

ORG = (("x-berth-org", "bench"),)
RUNS = 300


@dataclass(frozen=True)
class _WarmExec:
    via_service_ms: list[float]
    via_daemon_ms: list[float]


async def raw_spawn(argv: list[str]) -> None:
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    await proc.wait()


async def via_service(tmp: Path, **overrides: object) -> list[float]:
    """Warm ``Exec(true)`` latencies through the Sandbox service, on a unix
    socket in a 0700 control directory as ``berth serve`` runs it."""
    settings = Settings(data_dir=tmp, sandbox_idle_pause_s=0, internal_token=INTERNAL_TOKEN, **overrides)  # type: ignore[arg-type]
    control = tmp / "control"
    control.mkdir(mode=0o700, parents=True, exist_ok=True)
    address = f"unix:{control / 'sandbox.sock'}"
    service = await start_sandbox_service(settings, address=address)
    channel = internal_channel(address, "environment")
    stub = sandbox_service_pb2_grpc.SandboxServiceStub(channel)
    try:
        await stub.CreateSandbox(pb.CreateSandboxRequest(sandbox_id="sbx_bench"), metadata=ORG)

        async def via_service() -> None:
            async for _ in stub.Exec(pb.ExecRequest(sandbox_id="sbx_bench", argv=["true"]), metadata=ORG):
                pass

        return await measure(via_service, runs=RUNS)
    finally:
        try:
            await stub.DestroySandbox(pb.DestroySandboxRequest(sandbox_id="sbx_bench"), metadata=ORG)
        finally:
            await channel.close()
            await service.stop(0.2)


async def _via_daemon(tmp: Path, **overrides: object) -> list[float]:
    """The exec path without gRPC: the backend the service would build, and
    the daemon client the service would hold, in this process."""
    settings = Settings(data_dir=tmp, internal_token=INTERNAL_TOKEN, **overrides)  # type: ignore[arg-type]
    backend, _, _ = build_backend(settings)
    await backend.start()
    try:
        handle = await backend.create(SandboxSpec(sandbox_id="sbx_bench_daemon"))
        try:
            async with DaemonClient(backend.socket_path(handle)) as client:

                async def via_daemon() -> None:
                    async for _ in client.exec(argv=["true"]):
                        pass

                return await measure(via_daemon, runs=RUNS)
        finally:
            await backend.destroy(handle)
    finally:
        await backend.close()


async def _warm_exec(tmp: Path, **overrides: object) -> _WarmExec:
    return _WarmExec(
        via_service_ms=await via_service(tmp / "service", **overrides),
        via_daemon_ms=await _via_daemon(tmp / "daemon", **overrides),
    )


async def run(tmp: Path) -> list[Result]:
    true = shutil.which("true") or "/bin/true"
    isolated = await _warm_exec(tmp / "isolated")
    unconfined = await _warm_exec(tmp / "unconfined", sandbox_isolation="none")
    fork_ms = await measure(lambda: raw_spawn([true]), runs=RUNS)
    results = [
        summarize("sandbox Exec(true), warm (isolated)", isolated.via_service_ms, "raw fork+exec true", fork_ms, "p50 < 2x"),
        summarize("sandbox Exec(true), warm (no isolation)", unconfined.via_service_ms, "raw fork+exec true", fork_ms),
        summarize("sandboxd exec(true), no gRPC (isolated)", isolated.via_daemon_ms, "raw fork+exec true", fork_ms),
        summarize("sandbox Exec(true), warm (isolated)", isolated.via_service_ms, "sandboxd exec(true), no gRPC", isolated.via_daemon_ms),
    ]
    if shutil.which("bwrap"):
        bwrap = ["bwrap", "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
                 "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev", "--unshare-pid", true]
        bwrap_ms = await measure(lambda: raw_spawn(bwrap), runs=100)
        results.append(summarize("sandbox Exec(true), warm (isolated)", isolated.via_service_ms, "raw bwrap true (fresh)", bwrap_ms))
    return results
