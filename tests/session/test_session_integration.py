"""The Session service with the real Environment and Sandbox services, all
in-process on port 0, running commands in real bubblewrap sandboxes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from session_support import Client

from berth.session.v1 import session_pb2, session_service_pb2
from services.core.errors import reason_from_rpc_error
from services.core.settings import Settings

HOSTED = {"type": "openai_hosted"}
AGENT = {"model": "scripted"}


@pytest.fixture
async def real(tmp_path: Path, bwrap_available: None, client_for: Callable[[str], Client]) -> AsyncIterator[Client]:
    from services.environment.server import start_environment_service
    from services.sandbox.server import start_sandbox_service
    from services.session.server import start_session_service

    settings = Settings(data_dir=tmp_path / "berth", sandbox_idle_pause_s=0)
    sandbox = await start_sandbox_service(settings, address="127.0.0.1:0")
    settings = settings.model_copy(update={"sandbox_addr": sandbox.address})
    environment = await start_environment_service(settings, address="127.0.0.1:0")
    session = await start_session_service(settings, address="127.0.0.1:0", environment_addr=environment.address)
    try:
        yield client_for(session.address)
    finally:
        await session.stop(0.5)
        await environment.stop(0.5)
        await sandbox.stop(0.5)


async def artifacts(client: Client, session_id: str) -> list[Any]:
    r = await client.stub.ListArtifacts(session_service_pb2.ListArtifactsRequest(session_id=session_id), metadata=client.md)
    return list(r.artifacts)


async def content(client: Client, session_id: str, artifact_id: str) -> bytes:
    call = client.stub.GetArtifactContent(
        session_service_pb2.GetArtifactContentRequest(session_id=session_id, artifact_id=artifact_id), metadata=client.md
    )
    return b"".join([m.data async for m in call])


async def test_a_scripted_command_publishes_its_output_file_as_an_artifact(real: Client) -> None:
    created = await real.create_session({"agent": AGENT, "environment": HOSTED, "input": "$ echo hi > $REBYTE_OUTPUT_DIR/a.txt"})
    session_id = created.session.id
    end = await real.wait_turn_end(session_id, created.turn_id, timeout=60)
    assert end["type"] == "agent.session.turn.completed", end

    events = await real.events(session_id)
    assert [seq for seq, _ in events] == list(range(1, len(events) + 1))
    for _, event in events:
        real.validate(event)
    kinds = [e["type"] for _, e in events]
    assert kinds.index("agent.session.environment.pending") < kinds.index("agent.session.environment.ready")

    (artifact,) = await artifacts(real, session_id)
    assert artifact.path == "/workspace/outputs/a.txt" and artifact.size_bytes == 3 and artifact.turn_id == created.turn_id
    assert artifact.environment_id == created.session.environment_id
    assert await content(real, session_id, artifact.id) == b"hi\n"


async def test_cancel_during_sleep_ends_the_turn_within_two_seconds_and_kills_the_process(real: Client) -> None:
    created = await real.create_session(
        {"agent": AGENT, "environment": HOSTED, "input": "$ echo $$ > /workspace/pid; echo started; exec sleep 60"}
    )
    session_id = created.session.id
    await real.wait_for(session_id, lambda e: e["type"] == "agent.output.command_execution_output.delta", timeout=60)
    await real.submit(session_id, {"type": "agent.session.input.cancel"})
    end = await real.wait_turn_end(session_id, created.turn_id, timeout=2.0)
    assert end["type"] == "agent.session.turn.cancelled"

    check = await real.say(
        session_id,
        "$ P=$(cat /workspace/pid); for i in $(seq 50); do test -d /proc/$P || { echo gone; exit 0; }; sleep 0.1; done; echo alive",
    )
    await real.wait_turn_end(session_id, check, timeout=30)
    command = next(i for i in await real.items(session_id, check) if i["type"] == "command_execution")
    assert command["output"].strip() == "gone"


async def test_sessions_sharing_an_environment_each_publish_only_their_own_outputs(real: Client) -> None:
    owner = await real.create_session({"agent": AGENT, "environment": HOSTED})
    env_id = owner.session.environment_id
    ref = await real.create_session({"agent": AGENT, "environment": {"type": "reference", "environment_id": env_id}})
    t1 = await real.say(owner.session.id, "$ echo owner > $REBYTE_OUTPUT_DIR/owner.txt")
    assert (await real.wait_turn_end(owner.session.id, t1, timeout=60))["type"] == "agent.session.turn.completed"
    t2 = await real.say(ref.session.id, "$ echo ref > $REBYTE_OUTPUT_DIR/ref.txt; echo $REBYTE_OUTPUT_DIR")
    assert (await real.wait_turn_end(ref.session.id, t2, timeout=60))["type"] == "agent.session.turn.completed"
    t3 = await real.say(owner.session.id, "$ ls -R /workspace/outputs")
    assert (await real.wait_turn_end(owner.session.id, t3, timeout=60))["type"] == "agent.session.turn.completed"

    assert [a.path for a in await artifacts(real, owner.session.id)] == ["/workspace/outputs/owner.txt"]
    (ref_artifact,) = await artifacts(real, ref.session.id)
    assert ref_artifact.path == f"/workspace/outputs/sessions/{ref.session.id}/ref.txt"
    assert await content(real, ref.session.id, ref_artifact.id) == b"ref\n"
    command = next(i for i in await real.items(ref.session.id, t2) if i["type"] == "command_execution")
    assert command["output"].strip() == f"/workspace/outputs/sessions/{ref.session.id}"


async def test_a_failed_setup_fails_the_turn_with_sandbox_error_and_the_session_shows_it(real: Client) -> None:
    created = await real.create_session(
        {
            "agent": AGENT,
            "environment": {"type": "openai_hosted", "setup_commands": [{"command": "echo broken >&2; exit 3"}]},
            "input": "$ echo never",
        }
    )
    session_id = created.session.id
    end = await real.wait_turn_end(session_id, created.turn_id, timeout=60)
    assert end["type"] == "agent.session.turn.failed" and end["turn"]["error"]["code"] == "sandbox_error"
    session = await real.get_session(session_id)
    assert session.status == session_pb2.SESSION_STATUS_FAILED and session.error
    events = [e for _, e in await real.events(session_id)]
    for event in events:
        real.validate(event)
    assert events[-1]["type"] == "agent.session.failed"
    assert any(e["type"] == "agent.session.environment.failed" for e in events)


async def test_deleting_a_session_with_a_running_turn_is_refused_then_allowed(real: Client) -> None:
    created = await real.create_session({"agent": AGENT, "environment": HOSTED, "input": "$ echo go; sleep 60"})
    session_id = created.session.id
    await real.wait_for(session_id, lambda e: e["type"] == "agent.output.command_execution_output.delta", timeout=60)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await real.stub.DeleteSession(session_service_pb2.DeleteSessionRequest(session_id=session_id), metadata=real.md)
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert reason_from_rpc_error(error.value)[0] == "SESSION_ACTIVE"
    await real.submit(session_id, {"type": "agent.session.input.cancel"})
    await real.wait_turn_end(session_id, created.turn_id, timeout=5)
    await real.stub.DeleteSession(session_service_pb2.DeleteSessionRequest(session_id=session_id), metadata=real.md)
    with pytest.raises(grpc.aio.AioRpcError) as gone:
        await real.get_session(session_id)
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
