"""Berth services as processes of their own (``python -m services.<name>``),
for tests that kill one with SIGKILL: start, wait until serving, stop."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_support import TEST_INTERNAL_TOKEN, internal_channel

__all__ = ["REPO", "spawn_service", "wait_serving", "stop_process", "log_tail"]

REPO = Path(__file__).resolve().parents[1]


def spawn_service(module: str, log_path: Path, **settings: str) -> subprocess.Popen[bytes]:
    """Starts ``python -m <module>`` with only the given ``BERTH_*`` settings
    (JSON logs and the suite's internal token unless given), appending its
    output to ``log_path``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BERTH_")}
    env.update(BERTH_LOG_JSON="1", BERTH_INTERNAL_TOKEN=TEST_INTERNAL_TOKEN)
    env.update({f"BERTH_{name.upper()}": value for name, value in settings.items()})
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(
            [sys.executable, "-m", module],
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )


def log_tail(log_path: Path) -> str:
    return log_path.read_text(errors="replace")[-3000:] if log_path.exists() else ""


async def wait_serving(address: str, log_path: Path, *, what: str) -> None:
    """Waits (bounded) until the gRPC health check at ``address`` says SERVING."""
    channel = internal_channel(address)
    try:
        health = health_pb2_grpc.HealthStub(channel)
        response = await health.Check(health_pb2.HealthCheckRequest(), timeout=30, wait_for_ready=True)
    except grpc.aio.AioRpcError as exc:
        pytest.fail(f"{what} did not start ({exc.code().name}):\n{log_tail(log_path)}")
    finally:
        await channel.close()
    assert response.status == health_pb2.HealthCheckResponse.SERVING


async def stop_process(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if it has not ended within 15 s."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        await asyncio.to_thread(process.wait, 15)
    except subprocess.TimeoutExpired:
        process.kill()
        await asyncio.to_thread(process.wait)
