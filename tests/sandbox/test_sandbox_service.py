"""The Sandbox service over real gRPC on a real bubblewrap backend."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from sandbox_support import RestartableSandboxService as Service
from waiting import wait_until

from berth.common.v1 import common_pb2
from berth.sandbox.v1 import sandbox_pb2, sandbox_service_pb2 as pb, sandbox_service_pb2_grpc
from services.core.settings import Settings

ORG_A = (("x-berth-org", "org_a"),)
ORG_B = (("x-berth-org", "org_b"),)


@pytest.fixture
async def service(tmp_path: Path, bwrap_available: None) -> AsyncIterator[Service]:
    svc = Service(Settings(data_dir=tmp_path / "berth", sandbox_idle_pause_s=0))
    try:
        yield svc
    finally:
        await svc.stop()


async def run(stub: sandbox_service_pb2_grpc.SandboxServiceStub, sandbox_id: str, shell: str) -> tuple[int, bytes, bytes]:
    out, err, code = b"", b"", None
    async for msg in stub.Exec(pb.ExecRequest(sandbox_id=sandbox_id, shell=shell), metadata=ORG_A):
        if msg.HasField("chunk"):
            if msg.chunk.stream == common_pb2.OUTPUT_STREAM_STDOUT:
                out += msg.chunk.data
            else:
                err += msg.chunk.data
        else:
            code = msg.exit.exit_code
    assert code is not None
    return code, out, err


async def test_create_is_idempotent_and_exec_streams_output_and_exit_code(service: Service) -> None:
    stub = await service.start()
    first = await stub.CreateSandbox(pb.CreateSandboxRequest(sandbox_id="sbx_one"), metadata=ORG_A)
    again = await stub.CreateSandbox(pb.CreateSandboxRequest(sandbox_id="sbx_one"), metadata=ORG_A)
    assert first.sandbox.state == sandbox_pb2.SANDBOX_STATE_RUNNING
    assert again.sandbox.create_time == first.sandbox.create_time
    code, out, err = await run(stub, "sbx_one", "echo out; echo err >&2; exit 7")
    assert (code, out, err) == (7, b"out\n", b"err\n")


async def test_another_organization_gets_not_found(service: Service) -> None:
    stub = await service.start()
    await stub.CreateSandbox(pb.CreateSandboxRequest(sandbox_id="sbx_org"), metadata=ORG_A)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.GetSandbox(pb.GetSandboxRequest(sandbox_id="sbx_org"), metadata=ORG_B)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.WriteFile(pb.WriteFileRequest(sandbox_id="sbx_org", path="/workspace/x", data=b"x"), metadata=ORG_B)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_call_without_an_organization_is_rejected(service: Service) -> None:
    stub = await service.start()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.GetSandbox(pb.GetSandboxRequest(sandbox_id="sbx_x"))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_paths_outside_the_workspace_are_invalid_arguments(service: Service) -> None:
    stub = await service.start()
    await stub.CreateSandbox(pb.CreateSandboxRequest(sandbox_id="sbx_path"), metadata=ORG_A)
    for path in ("/etc/passwd", "/workspace/../etc/passwd", "../../etc/shadow"):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.WriteFile(pb.WriteFileRequest(sandbox_id="sbx_path", path=path, data=b"x"), metadata=ORG_A)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_file_written_before_an_idle_pause_is_read_after_transparent_resume(tmp_path: Path, bwrap_available: None) -> None:
    svc = Service(Settings(data_dir=tmp_path / "berth", sandbox_idle_pause_s=1.0))
    stub = await svc.start()
    try:
        await stub.CreateSandbox(pb.CreateSandboxRequest(sandbox_id="sbx_pause"), metadata=ORG_A)
        await stub.WriteFile(
            pb.WriteFileRequest(sandbox_id="sbx_pause", path="/workspace/keep.txt", data=b"kept"), metadata=ORG_A
        )

        async def paused() -> bool:
            got = await stub.GetSandbox(pb.GetSandboxRequest(sandbox_id="sbx_pause"), metadata=ORG_A)
            return got.sandbox.state == sandbox_pb2.SANDBOX_STATE_PAUSED

        await wait_until(paused)
        data = b""
        async for chunk in stub.ReadFile(pb.ReadFileRequest(sandbox_id="sbx_pause", path="/workspace/keep.txt"), metadata=ORG_A):
            data += chunk.data
        assert data == b"kept"
        got = await stub.GetSandbox(pb.GetSandboxRequest(sandbox_id="sbx_pause"), metadata=ORG_A)
        assert got.sandbox.state == sandbox_pb2.SANDBOX_STATE_RUNNING
    finally:
        await svc.stop()


async def test_an_idle_sandbox_is_paused_and_a_keepalive_process_prevents_it(tmp_path: Path, bwrap_available: None) -> None:
    svc = Service(Settings(data_dir=tmp_path / "berth", sandbox_idle_pause_s=0.3))
    stub = await svc.start()
    try:
        await stub.CreateSandbox(pb.CreateSandboxRequest(sandbox_id="sbx_idle"), metadata=ORG_A)
        await stub.CreateSandbox(pb.CreateSandboxRequest(sandbox_id="sbx_keep"), metadata=ORG_A)
        await stub.StartProcess(
            pb.StartProcessRequest(sandbox_id="sbx_keep", name="server", shell="sleep 600", keepalive=True), metadata=ORG_A
        )

        async def idle_paused() -> bool:
            got = await stub.GetSandbox(pb.GetSandboxRequest(sandbox_id="sbx_idle"), metadata=ORG_A)
            return got.sandbox.state == sandbox_pb2.SANDBOX_STATE_PAUSED

        await wait_until(idle_paused, what="the idle sandbox paused")
        kept = await stub.GetSandbox(pb.GetSandboxRequest(sandbox_id="sbx_keep"), metadata=ORG_A)
        assert kept.sandbox.state == sandbox_pb2.SANDBOX_STATE_RUNNING
        code, out, _ = await run(stub, "sbx_idle", "echo awake")
        assert (code, out) == (0, b"awake\n")
    finally:
        await svc.stop()


async def test_a_service_restart_keeps_the_sandbox_and_its_running_process(service: Service) -> None:
    stub = await service.start()
    await stub.CreateSandbox(pb.CreateSandboxRequest(sandbox_id="sbx_restart"), metadata=ORG_A)
    started = await stub.StartProcess(
        pb.StartProcessRequest(sandbox_id="sbx_restart", name="ticker", shell="i=0; while true; do echo $i; i=$((i+1)); sleep 0.05; done"),
        metadata=ORG_A,
    )
    await service.stop()
    stub = await service.start()
    listed = await stub.ListProcesses(pb.ListProcessesRequest(sandbox_id="sbx_restart"), metadata=ORG_A)
    assert [p.process_id for p in listed.processes if p.running] == [started.process.process_id]
    seen = b""
    async for msg in stub.AttachProcess(
        pb.AttachProcessRequest(sandbox_id="sbx_restart", process_id=started.process.process_id, from_seq=0), metadata=ORG_A
    ):
        seen += msg.chunk.data
        if seen.count(b"\n") >= 3:
            break
    assert seen.startswith(b"0\n1\n2\n")
    await stub.KillProcess(pb.KillProcessRequest(sandbox_id="sbx_restart", process_id=started.process.process_id), metadata=ORG_A)


async def test_cancelling_an_exec_call_kills_its_command(service: Service) -> None:
    stub = await service.start()
    await stub.CreateSandbox(pb.CreateSandboxRequest(sandbox_id="sbx_cancel"), metadata=ORG_A)
    call = stub.Exec(pb.ExecRequest(sandbox_id="sbx_cancel", shell="echo $$ > /workspace/pid; echo started; exec sleep 60"), metadata=ORG_A)
    first = await call.read()
    assert first.chunk.data == b"started\n"
    call.cancel()

    async def gone() -> bool:
        code, out, _ = await run(stub, "sbx_cancel", "kill -0 $(cat /workspace/pid) 2>/dev/null && echo alive || echo dead")
        return out.strip() == b"dead"

    await wait_until(gone, what="the cancelled command was killed")


async def test_destroy_removes_the_sandbox(service: Service) -> None:
    stub = await service.start()
    await stub.CreateSandbox(pb.CreateSandboxRequest(sandbox_id="sbx_gone"), metadata=ORG_A)
    await stub.DestroySandbox(pb.DestroySandboxRequest(sandbox_id="sbx_gone"), metadata=ORG_A)
    await stub.DestroySandbox(pb.DestroySandboxRequest(sandbox_id="sbx_gone"), metadata=ORG_A)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.GetSandbox(pb.GetSandboxRequest(sandbox_id="sbx_gone"), metadata=ORG_A)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert not (service.settings.data_dir / "sandboxes" / "sbx_gone").exists()


async def test_the_state_gauge_follows_creates_and_destroys_within_its_refresh_period(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prometheus_client import REGISTRY

    from services.sandbox import manager

    monkeypatch.setattr(manager, "GAUGE_REFRESH_S", 0.05)

    def count(state: str) -> float:
        return REGISTRY.get_sample_value("berth_sandboxes", {"state": state}) or 0.0

    stub = await service.start()
    running, destroyed = count("running"), count("destroyed")
    await stub.CreateSandbox(pb.CreateSandboxRequest(sandbox_id="sbx_gauge"), metadata=ORG_A)
    await wait_until(lambda: count("running") == running + 1, timeout=10, what="the gauge to count the new sandbox")
    await stub.DestroySandbox(pb.DestroySandboxRequest(sandbox_id="sbx_gauge"), metadata=ORG_A)
    await wait_until(
        lambda: count("running") == running and count("destroyed") == destroyed + 1,
        timeout=10,
        what="the gauge to count the sandbox destroyed",
    )


async def test_make_directory_makes_missing_parents_accepts_an_existing_one_and_stays_in_the_workspace(service: Service) -> None:
    stub = await service.start()
    await stub.CreateSandbox(pb.CreateSandboxRequest(sandbox_id="sbx_dirs"), metadata=ORG_A)
    await stub.MakeDirectory(pb.MakeDirectoryRequest(sandbox_id="sbx_dirs", path="/workspace/outputs/sessions/s1"), metadata=ORG_A)
    await stub.MakeDirectory(pb.MakeDirectoryRequest(sandbox_id="sbx_dirs", path="/workspace/outputs/sessions/s1"), metadata=ORG_A)
    code, out, _ = await run(stub, "sbx_dirs", "test -d /workspace/outputs/sessions/s1 && echo dir")
    assert (code, out) == (0, b"dir\n")
    for path in ("/etc/berth", "/workspace/../tmp/x"):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.MakeDirectory(pb.MakeDirectoryRequest(sandbox_id="sbx_dirs", path=path), metadata=ORG_A)
        assert info.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED)
    code, _, _ = await run(stub, "sbx_dirs", "test -e /etc/berth || test -e /tmp/x")
    assert code != 0
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.MakeDirectory(pb.MakeDirectoryRequest(sandbox_id="sbx_dirs", path="/workspace/theirs"), metadata=ORG_B)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
