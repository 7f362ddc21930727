"""Prometheus metrics: every gRPC service counts requests and their latency
by method and status code, the Environment service keeps the environments
gauge by status current, each service process serves its metrics on
BERTH_METRICS_PORT, and the gateway serves /metrics without a key."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import prometheus_client
import pytest
from grpc_support import internal_channel
from hosts_support import free_port
from waiting import wait_until

from berth.environment.v1 import environment_pb2, environment_service_pb2 as pb, environment_service_pb2_grpc
from berth.sandbox.v1 import sandbox_service_pb2, sandbox_service_pb2_grpc
from berth.session.v1 import session_service_pb2, session_service_pb2_grpc
from services.core.service import ServiceHandle
from services.core.settings import Settings
from services.environment.server import start_environment_service

ORG = (("x-berth-org", "org_a"),)
REPO = Path(__file__).resolve().parents[2]
CREATE = "/berth.environment.v1.EnvironmentService/CreateEnvironment"
GET = "/berth.environment.v1.EnvironmentService/GetEnvironment"


def _sample(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample in the text exposition format, whatever the label order."""
    for line in text.splitlines():
        match = re.fullmatch(rf"{re.escape(name)}\{{(.*)\}} (\S+)", line)
        if match is None:
            continue
        found = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(1)))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(2))
    return None


@pytest.fixture
async def environment_service(tmp_path: Path) -> AsyncIterator[ServiceHandle]:
    settings = Settings(data_dir=tmp_path / "berth", sandbox_addr="127.0.0.1:1", rpc_timeout_s=5)
    handle = await start_environment_service(settings, address="127.0.0.1:0")
    try:
        yield handle
    finally:
        await handle.stop(0.2)


async def test_rpcs_are_counted_by_method_and_code_and_pending_environments_are_gauged(
    environment_service: ServiceHandle,
) -> None:
    async with internal_channel(environment_service.address) as channel:
        stub = environment_service_pb2_grpc.EnvironmentServiceStub(channel)
        created = await stub.CreateEnvironment(
            pb.CreateEnvironmentRequest(config=environment_pb2.EnvironmentConfig()), metadata=ORG
        )
        await stub.GetEnvironment(pb.GetEnvironmentRequest(environment_id=created.environment.id), metadata=ORG)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.GetEnvironment(pb.GetEnvironmentRequest(environment_id="env_missing"), metadata=ORG)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND

    def exposition() -> str:
        return prometheus_client.generate_latest().decode()

    text = exposition()
    assert (_sample(text, "berth_rpc_requests_total", method=CREATE, code="OK") or 0) >= 1
    assert (_sample(text, "berth_rpc_requests_total", method=GET, code="OK") or 0) >= 1
    assert (_sample(text, "berth_rpc_requests_total", method=GET, code="NOT_FOUND") or 0) >= 1
    assert (_sample(text, "berth_rpc_latency_seconds_count", method=GET, code="NOT_FOUND") or 0) >= 1
    assert _sample(text, "berth_rpc_latency_seconds_bucket", method=CREATE, code="OK", le="+Inf") is not None
    # The gauge is refreshed from the database shortly after a transition.
    await wait_until(lambda: (_sample(exposition(), "berth_environments", status="pending") or 0) >= 1)


async def test_the_gateway_serves_metrics_without_a_key(tmp_path: Path, environment_service: ServiceHandle) -> None:
    from gateway.app import start_gateway

    settings = Settings(data_dir=tmp_path / "gateway", rpc_timeout_s=5, grace_s=1)
    gateway = await start_gateway(
        settings, port=0, host="127.0.0.1", environment_addr=environment_service.address, session_addr="127.0.0.1:1"
    )
    try:
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=10) as http:
            denied = await http.get("/v1/agents/environments", headers={"OpenAI-Beta": "agents=v1"})
            assert denied.status_code == 401
            response = await http.get("/metrics")
        assert response.status_code == 200
        assert "berth_http_requests_total" in response.text
        assert (_sample(response.text, "berth_http_requests_total", method="GET", status="401") or 0) >= 1
    finally:
        await gateway.stop()


async def _first_rpc(service: str, address: str) -> str:
    """One Berth RPC against the service; returns its full method name."""
    async with internal_channel(address) as channel:
        if service == "environment":
            await environment_service_pb2_grpc.EnvironmentServiceStub(channel).ListEnvironments(
                pb.ListEnvironmentsRequest(), metadata=ORG, timeout=10, wait_for_ready=True
            )
            return "/berth.environment.v1.EnvironmentService/ListEnvironments"
        if service == "session":
            await session_service_pb2_grpc.SessionServiceStub(channel).ListAgents(
                session_service_pb2.ListAgentsRequest(), metadata=ORG, timeout=10, wait_for_ready=True
            )
            return "/berth.session.v1.SessionService/ListAgents"
        await sandbox_service_pb2_grpc.SandboxServiceStub(channel).CountSandboxes(
            sandbox_service_pb2.CountSandboxesRequest(), metadata=ORG, timeout=10, wait_for_ready=True
        )
        return "/berth.sandbox.v1.SandboxService/CountSandboxes"


@pytest.mark.parametrize("service", ["session", "environment", "sandbox"])
async def test_a_service_process_serves_its_request_metrics_on_the_metrics_port(service: str, tmp_path: Path) -> None:
    grpc_port, metrics_port = free_port(), free_port()
    env = {
        **os.environ,
        "BERTH_DATA_DIR": str(tmp_path / "berth"),
        f"BERTH_{service.upper()}_ADDR": f"127.0.0.1:{grpc_port}",
        "BERTH_METRICS_PORT": str(metrics_port),
        "BERTH_SANDBOX_IDLE_PAUSE_S": "0",
        "BERTH_LOG_LEVEL": "WARNING",
    }
    for name in ("BERTH_SESSION_DATABASE_URL", "BERTH_ENVIRONMENT_DATABASE_URL", "BERTH_SANDBOX_DATABASE_URL"):
        env.pop(name, None)
    process = subprocess.Popen(
        [sys.executable, "-m", f"services.{service}"], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        method = await asyncio.wait_for(_first_rpc(service, f"127.0.0.1:{grpc_port}"), 30)
        async with httpx.AsyncClient(timeout=10) as http:
            response = await http.get(f"http://127.0.0.1:{metrics_port}/metrics")
        assert response.status_code == 200
        assert (_sample(response.text, "berth_rpc_requests_total", method=method, code="OK") or 0) >= 1
        assert (_sample(response.text, "berth_rpc_latency_seconds_count", method=method, code="OK") or 0) >= 1
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            _, stderr = process.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            _, stderr = process.communicate()
    assert process.returncode == 0, stderr.decode(errors="replace")[-2000:]
