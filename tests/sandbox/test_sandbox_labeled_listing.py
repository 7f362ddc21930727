"""ListLabeledSandboxes and CountSandboxes: the internal cross-organization
listing the Environment service's reconciler reads, and the count its
placement reads, over real gRPC on bubblewrap."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import TypeAlias

import grpc
import pytest
from grpc_support import internal_channel
from waiting import wait_until

from berth.sandbox.v1 import sandbox_pb2, sandbox_service_pb2 as pb, sandbox_service_pb2_grpc
from services.core.settings import Settings
from services.sandbox.server import start_sandbox_service

LABEL = "berth.environment_id"
ORG_A = (("x-berth-org", "org_a"),)
ORG_B = (("x-berth-org", "org_b"),)
CALLER = (("x-berth-org", "berth.environment-reconciler"),)

Stub: TypeAlias = sandbox_service_pb2_grpc.SandboxServiceStub


@pytest.fixture
async def stub(tmp_path: Path) -> AsyncIterator[Stub]:
    handle = await start_sandbox_service(Settings(data_dir=tmp_path / "berth", sandbox_idle_pause_s=0), address="127.0.0.1:0")
    channel = internal_channel(handle.address)
    try:
        yield sandbox_service_pb2_grpc.SandboxServiceStub(channel)
    finally:
        await channel.close()
        await handle.stop(0.2)


async def test_every_organizations_labelled_sandboxes_are_listed_with_their_organization_and_label_value(stub: Stub) -> None:
    await stub.CreateSandbox(pb.CreateSandboxRequest(sandbox_id="sbx_a", labels={LABEL: "env_a"}), metadata=ORG_A)
    await stub.CreateSandbox(pb.CreateSandboxRequest(sandbox_id="sbx_b", labels={LABEL: "env_b"}), metadata=ORG_B)
    await stub.CreateSandbox(pb.CreateSandboxRequest(sandbox_id="sbx_plain", labels={"other": "x"}), metadata=ORG_A)
    await stub.CreateSandbox(pb.CreateSandboxRequest(sandbox_id="sbx_gone", labels={LABEL: "env_gone"}), metadata=ORG_A)
    await stub.DestroySandbox(pb.DestroySandboxRequest(sandbox_id="sbx_gone"), metadata=ORG_A)

    listed = await stub.ListLabeledSandboxes(pb.ListLabeledSandboxesRequest(label_key=LABEL), metadata=CALLER)

    assert [(s.sandbox_id, s.org_id, s.label_value) for s in listed.sandboxes] == [
        ("sbx_a", "org_a", "env_a"),
        ("sbx_b", "org_b", "env_b"),
    ]
    assert {s.state for s in listed.sandboxes} == {sandbox_pb2.SANDBOX_STATE_RUNNING}
    assert all(s.create_time.seconds > 0 for s in listed.sandboxes)
    assert listed.next_page_token == ""


async def test_labelled_sandboxes_are_listed_page_by_page(stub: Stub) -> None:
    for i in range(3):
        await stub.CreateSandbox(pb.CreateSandboxRequest(sandbox_id=f"sbx_{i}", labels={LABEL: f"env_{i}"}), metadata=ORG_A)
    seen: list[str] = []
    token = ""
    for _ in range(3):
        page = await stub.ListLabeledSandboxes(
            pb.ListLabeledSandboxesRequest(label_key=LABEL, page_size=2, page_token=token), metadata=CALLER
        )
        seen += [s.sandbox_id for s in page.sandboxes]
        token = page.next_page_token
        if not token:
            break
    assert seen == ["sbx_0", "sbx_1", "sbx_2"]


async def test_listing_labelled_sandboxes_needs_a_label_key(stub: Stub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.ListLabeledSandboxes(pb.ListLabeledSandboxesRequest(), metadata=CALLER)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_every_organizations_live_sandboxes_are_counted_and_destroyed_ones_are_not(tmp_path: Path) -> None:
    # Idle sandboxes pause here, and a paused sandbox still holds resources.
    handle = await start_sandbox_service(Settings(data_dir=tmp_path / "berth", sandbox_idle_pause_s=0.5), address="127.0.0.1:0")
    channel = internal_channel(handle.address)
    stub = sandbox_service_pb2_grpc.SandboxServiceStub(channel)
    try:
        assert (await stub.CountSandboxes(pb.CountSandboxesRequest(), metadata=CALLER)).live_count == 0
        await stub.CreateSandbox(pb.CreateSandboxRequest(sandbox_id="sbx_a"), metadata=ORG_A)
        await stub.CreateSandbox(pb.CreateSandboxRequest(sandbox_id="sbx_b", labels={LABEL: "env_b"}), metadata=ORG_B)
        await stub.CreateSandbox(pb.CreateSandboxRequest(sandbox_id="sbx_paused"), metadata=ORG_A)
        await stub.CreateSandbox(pb.CreateSandboxRequest(sandbox_id="sbx_gone"), metadata=ORG_A)
        await stub.DestroySandbox(pb.DestroySandboxRequest(sandbox_id="sbx_gone"), metadata=ORG_A)

        async def paused() -> bool:
            got = await stub.GetSandbox(pb.GetSandboxRequest(sandbox_id="sbx_paused"), metadata=ORG_A)
            return got.sandbox.state == sandbox_pb2.SANDBOX_STATE_PAUSED

        await wait_until(paused)
        counted = await stub.CountSandboxes(pb.CountSandboxesRequest(), metadata=CALLER)

        assert counted.live_count == 3
    finally:
        for sandbox_id in ("sbx_a", "sbx_b", "sbx_paused"):
            await stub.DestroySandbox(
                pb.DestroySandboxRequest(sandbox_id=sandbox_id), metadata=ORG_B if sandbox_id == "sbx_b" else ORG_A
            )
        await channel.close()
        await handle.stop(0.2)
