"""The automation scheduler across replicas and restarts, on SQLite and
PostgreSQL, driven by an injected clock: no test waits for a real minute.

Two Session service servers share one database and one fake clock; the
clock jumps a minute at a time and each occurrence of a minute-level cron
fires exactly once, whichever replica sees it first. A server started after
downtime fires the most recent missed occurrence once (the catch-up rule)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_support import internal_channel
from session_support import ORG, Client
from waiting import wait_until

from berth.session.v1 import automation_pb2 as apb
from berth.session.v1 import automation_service_pb2 as asvc
from berth.session.v1 import automation_service_pb2_grpc, session_pb2
from berth.session.v1 import session_service_pb2 as svc
from services.core.service import ServiceHandle
from services.core.settings import Settings
from services.session.server import start_session_service

# 2026-01-01T00:00:30Z: half a minute before the first minute-level occurrence.
T0 = 1767225630.0
MINUTE = 60.0


@dataclass
class FakeClock:
    now: float = T0
    # How often each replica read the clock: a replica that read it again
    # after a jump has finished a pass over the schedule at the new time.
    reads: dict[str, int] = field(default_factory=dict)

    def for_replica(self, name: str) -> Callable[[], float]:
        def read() -> float:
            self.reads[name] = self.reads.get(name, 0) + 1
            return self.now

        return read


@dataclass
class Replicas:
    settings: Settings
    env_addr: str
    clock: FakeClock
    handles: dict[str, ServiceHandle] = field(default_factory=dict)

    async def start(self, name: str) -> ServiceHandle:
        handle = await start_session_service(
            self.settings, address="127.0.0.1:0", environment_addr=self.env_addr, clock=self.clock.for_replica(name)
        )
        self.handles[name] = handle
        return handle

    async def stop(self, name: str) -> None:
        await self.handles.pop(name).stop(0)


@pytest.fixture
async def replicas(tmp_path: Path, database_url: str, fake_env: Any) -> AsyncIterator[Replicas]:
    settings = Settings(data_dir=tmp_path / "data", session_database_url=database_url, automation_poll_s=0.05)
    r = Replicas(settings, f"127.0.0.1:{fake_env[1].port}", FakeClock())
    yield r
    for name in list(r.handles):
        await r.stop(name)


def automations_stub(handle: ServiceHandle) -> automation_service_pb2_grpc.AutomationServiceStub:
    return automation_service_pb2_grpc.AutomationServiceStub(internal_channel(handle.address))


MD = (("x-berth-org", ORG),)


async def existing_session_automation(
    client: Client, stub: automation_service_pb2_grpc.AutomationServiceStub, expression: str
) -> tuple[str, str]:
    created = await client.create_session({"agent": {"model": "scripted"}, "environment": {"type": "none"}})
    session_id = created.session.id
    automation = apb.Automation(
        name="every minute",
        kind=apb.AUTOMATION_KIND_PERIODIC,
        expression=expression,
        timezone="UTC",
        target=apb.AutomationTarget(
            existing_session=apb.ExistingSessionTarget(session_id=session_id, instructions="tick")
        ),
    )
    response = await stub.CreateAutomation(asvc.CreateAutomationRequest(automation=automation), metadata=MD)
    return response.automation.id, session_id


async def invocations(stub: automation_service_pb2_grpc.AutomationServiceStub, automation_id: str) -> list[Any]:
    response = await stub.ListInvocations(
        asvc.ListInvocationsRequest(automation_id=automation_id, page=svc.PageRequest(limit=100, order="asc")),
        metadata=MD,
    )
    return list(response.invocations)


async def delivered(stub: automation_service_pb2_grpc.AutomationServiceStub, automation_id: str, count: int) -> list[Any] | None:
    found = await invocations(stub, automation_id)
    done = [i for i in found if i.status == apb.INVOCATION_STATUS_COMPLETED]
    return found if len(done) >= count else None


async def all_looked_again(replicas: Replicas) -> bool:
    """Every running replica read the clock a few more times: it finished
    passes over the schedule after the last jump."""
    clock = replicas.clock
    seen = {name: clock.reads.get(name, 0) for name in replicas.handles}

    async def later() -> bool:
        return all(clock.reads[name] >= seen[name] + 4 for name in seen)

    return bool(await wait_until(later, 10.0, what="the schedulers passed over the schedule again"))


async def test_two_replicas_fire_each_minute_of_a_cron_exactly_once(
    replicas: Replicas, client_for: Callable[[str], Client]
) -> None:
    a = await replicas.start("a")
    await replicas.start("b")
    stub = automations_stub(a)
    automation_id, session_id = await existing_session_automation(client_for(a.address), stub, "* * * * *")

    minutes = 5
    for k in range(1, minutes + 1):
        replicas.clock.now = T0 + k * MINUTE
        await wait_until(lambda: delivered(stub, automation_id, k), 20.0, what=f"occurrence {k} delivered")
    await all_looked_again(replicas)

    found = await invocations(stub, automation_id)
    expected = [int(T0 - 30 + k * MINUTE) for k in range(1, minutes + 1)]
    assert [i.scheduled_at for i in found] == expected
    assert {i.status for i in found} == {apb.INVOCATION_STATUS_COMPLETED}
    assert {i.session_id for i in found} == {session_id}
    # Each delivery is a user message in the target session (an item once its turn starts).
    client = client_for(a.address)

    async def user_messages() -> list[Any] | None:
        found = [i for i in await client.items(session_id) if i.get("role") == "user"]
        return found if len(found) >= minutes else None

    assert len(await wait_until(user_messages, 20.0, what="every delivery's turn started")) == minutes


async def test_a_restarted_scheduler_fires_the_latest_missed_occurrence_once(
    replicas: Replicas, client_for: Callable[[str], Client]
) -> None:
    a = await replicas.start("a")
    stub = automations_stub(a)
    automation_id, _ = await existing_session_automation(client_for(a.address), stub, "* * * * *")
    once = apb.Automation(
        name="once during downtime",
        kind=apb.AUTOMATION_KIND_ONCE,
        run_at=int(T0 + 2 * MINUTE),
        target=apb.AutomationTarget(
            new_session=apb.NewSessionTarget(
                session=svc.CreateSessionRequest(
                    agent=session_pb2.AgentConfig(model="scripted"),
                    environment=svc.SessionEnvironment(none=svc.NoEnvironment()),
                    input=[svc.UserMessage(content=[svc.UserContent(text="late but once")])],
                )
            )
        ),
    )
    once_id = (await stub.CreateAutomation(asvc.CreateAutomationRequest(automation=once), metadata=MD)).automation.id
    await replicas.stop("a")

    replicas.clock.now = T0 + 10 * MINUTE  # ten minutes of downtime
    b = await replicas.start("b")
    stub = automations_stub(b)
    found = await wait_until(lambda: delivered(stub, automation_id, 1), 20.0, what="catch-up delivered")
    late = await wait_until(lambda: delivered(stub, once_id, 1), 20.0, what="one-time automation delivered late")
    await all_looked_again(replicas)

    found = await invocations(stub, automation_id)
    assert [i.scheduled_at for i in found] == [int(T0 - 30 + 10 * MINUTE)]
    late = await invocations(stub, once_id)
    assert [i.scheduled_at for i in late] == [int(T0 + 2 * MINUTE)]
    assert late[0].session_id
    got = await stub.GetAutomation(asvc.GetAutomationRequest(automation_id=once_id), metadata=MD)
    assert got.automation.status == apb.AUTOMATION_STATUS_COMPLETED
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.PauseAutomation(asvc.PauseAutomationRequest(automation_id=once_id), metadata=MD)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    # The schedule continues with the first occurrence after the restart.
    replicas.clock.now = T0 + 11 * MINUTE
    found = await wait_until(lambda: delivered(stub, automation_id, 2), 20.0, what="next occurrence delivered")
    assert [i.scheduled_at for i in found] == [int(T0 - 30 + 10 * MINUTE), int(T0 - 30 + 11 * MINUTE)]
