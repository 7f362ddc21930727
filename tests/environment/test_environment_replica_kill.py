"""Two Environment service replicas as separate processes on one PostgreSQL
database, with the real Sandbox service: SIGKILL the replica that owns a
running setup, and the other replica takes the setup over once the lease
expires, in the same sandbox, runs the interrupted setup command again and
finishes it; the commands before it are not run again.

The in-process variants (a graceful stop, an expired lease written by hand,
fifty first operations split across two instances on PostgreSQL) are in
test_environment_init_guard.py and test_environment_setup_journal.py; this
one kills a real process, so nothing of the owner's shutdown path runs."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from environment_helpers import SandboxService, create_env, ensure, md, run_command, setup_config
from grpc_support import internal_channel
from hosts_support import free_port
from service_processes import spawn_service, stop_process, wait_serving
from waiting import wait_until

from berth.environment.v1 import environment_pb2, environment_service_pb2 as pb, environment_service_pb2_grpc
from berth.sandbox.v1 import sandbox_service_pb2

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(120)]

LEASE_S = 1.5
READY = environment_pb2.ENVIRONMENT_STATUS_READY
MARKER = "berth-setup-gate"
FIRST = "echo first >> /workspace/steps"
LAST = "echo last >> /workspace/steps"
# Counts its runs, then blocks until the test releases it.
GATED_SETUP = (
    f"echo run >> /workspace/setup-runs; "
    f"while [ ! -e /workspace/release ]; do sleep 0.05; done  # {MARKER}"
)
# Prints the PIDs of live processes whose command line carries the marker.
FIND_MARKED = """
import os, sys
for pid in os.listdir("/proc"):
    if not pid.isdigit() or int(pid) == os.getpid():
        continue
    try:
        cmdline = open("/proc/%s/cmdline" % pid, "rb").read()
        state = open("/proc/%s/stat" % pid).read().rsplit(")", 1)[1].split()[0]
    except OSError:
        continue
    if state != "Z" and sys.argv[1].encode() in cmdline:
        print(pid)
"""


@dataclass
class Replica:
    name: str
    process: subprocess.Popen[bytes]
    address: str
    log_path: Path
    channel: grpc.aio.Channel

    @property
    def stub(self) -> environment_service_pb2_grpc.EnvironmentServiceStub:
        return environment_service_pb2_grpc.EnvironmentServiceStub(self.channel)


class Replicas:
    """``python -m services.environment`` processes; every one left running
    is stopped (SIGTERM, then SIGKILL) at teardown."""

    def __init__(self, tmp_path: Path, database_url: str, sandbox_addr: str) -> None:
        self.tmp_path = tmp_path
        self.database_url = database_url
        self.sandbox_addr = sandbox_addr
        self.started: list[Replica] = []

    def spawn(self, name: str) -> Replica:
        address = f"127.0.0.1:{free_port()}"
        log_path = self.tmp_path / f"{name}.log"
        process = spawn_service(
            "services.environment",
            log_path,
            environment_addr=address,
            environment_database_url=self.database_url,
            sandbox_addr=self.sandbox_addr,
            init_lease_s=str(LEASE_S),
            data_dir=str(self.tmp_path / name),
            rpc_timeout_s="10",
        )
        replica = Replica(name, process, address, log_path, internal_channel(address))
        self.started.append(replica)
        return replica

    async def serving(self, replica: Replica) -> None:
        await wait_serving(replica.address, replica.log_path, what=f"replica {replica.name}")

    async def stop_all(self) -> None:
        for replica in self.started:
            await replica.channel.close()
            await stop_process(replica.process)


@pytest.fixture
async def replicas(tmp_path: Path, fresh_postgres_database: str, sandbox_service: SandboxService) -> AsyncIterator[Replicas]:
    group = Replicas(tmp_path, fresh_postgres_database, sandbox_service.address)
    try:
        yield group
    finally:
        await group.stop_all()


async def _lease_row(database_url: str, environment_id: str) -> tuple[str, str, float]:
    import asyncpg

    conn = await asyncpg.connect(database_url, timeout=3)
    try:
        row = await conn.fetchrow(
            "SELECT status, lease_owner, lease_expires_at FROM environments WHERE id = $1", environment_id
        )
    finally:
        await conn.close()
    assert row is not None
    return str(row["status"]), str(row["lease_owner"]), float(row["lease_expires_at"])


async def _lines(sandbox: SandboxService, sandbox_id: str, path: str) -> list[str]:
    try:
        return (await sandbox.read(sandbox_id, path)).decode().splitlines()
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            return []
        raise


async def _setup_runs(sandbox: SandboxService, sandbox_id: str) -> list[str]:
    return await _lines(sandbox, sandbox_id, "/workspace/setup-runs")


async def _marked_processes(sandbox: SandboxService, sandbox_id: str) -> list[str]:
    out = b""
    request = sandbox_service_pb2.ExecRequest(sandbox_id=sandbox_id, argv=["python3", "-c", FIND_MARKED, MARKER])
    async for message in sandbox.stub.Exec(request, metadata=md()):
        if message.HasField("chunk"):
            out += message.chunk.data
    return out.decode().split()


async def test_killing_the_replica_that_runs_setup_hands_it_to_the_other_once_its_lease_expires(
    replicas: Replicas, sandbox_service: SandboxService
) -> None:
    one, two = replicas.spawn("replica-1"), replicas.spawn("replica-2")
    await asyncio.gather(replicas.serving(one), replicas.serving(two))

    env = (await create_env(two.stub, config=setup_config(FIRST, GATED_SETUP, LAST))).environment

    # Replica 1 wins the init: its second setup command runs, blocked on the gate.
    owner_call = asyncio.ensure_future(ensure(one.stub, env.id))

    async def runs_reached(count: int) -> bool:
        if owner_call.done() and count == 1:
            return True
        try:
            return len(await _setup_runs(sandbox_service, env.sandbox_id)) == count
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                return False  # the sandbox is still being created
            raise

    await wait_until(lambda: runs_reached(1), timeout=30, what="setup started through replica 1")
    assert not owner_call.done(), owner_call
    status, lease_owner, _ = await _lease_row(replicas.database_url, env.id)
    assert status == "initializing"
    assert lease_owner.split(":")[1] == str(one.process.pid), lease_owner

    # Replica 2 joins the running operation and waits for it.
    waiter = asyncio.ensure_future(ensure(two.stub, env.id))
    joined_at = time.time()

    one.process.send_signal(signal.SIGKILL)
    await asyncio.to_thread(one.process.wait, 10)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(owner_call, 10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    # The owner's last renewal still holds: nobody takes a live lease over.
    status, lease_owner, expires_at = await _lease_row(replicas.database_url, env.id)
    assert status == "initializing" and lease_owner.split(":")[1] == str(one.process.pid)
    assert not waiter.done()

    # Replica 2 takes over after the lease expired and runs the interrupted command again.
    await wait_until(lambda: runs_reached(2), timeout=LEASE_S + 20, what="replica 2 ran the interrupted command again")
    taken_at = time.time()
    assert joined_at < expires_at <= taken_at, "setup was taken over before the lease expired"
    status, lease_owner, _ = await _lease_row(replicas.database_url, env.id)
    assert status == "initializing"
    assert lease_owner.split(":")[1] == str(two.process.pid), lease_owner
    assert not waiter.done()

    await sandbox_service.stub.WriteFile(
        sandbox_service_pb2.WriteFileRequest(sandbox_id=env.sandbox_id, path="/workspace/release", data=b""), metadata=md()
    )
    result = await asyncio.wait_for(waiter, 20)
    assert result.status == READY and result.error.code == ""
    assert result.sandbox_id == env.sandbox_id
    assert await _lines(sandbox_service, env.sandbox_id, "/workspace/steps") == ["first", "last"]
    assert await _setup_runs(sandbox_service, env.sandbox_id) == ["run", "run"]
    assert (await _lease_row(replicas.database_url, env.id))[0] == "ready"

    async def gated_ended() -> bool:
        return await _marked_processes(sandbox_service, env.sandbox_id) == []

    await wait_until(gated_ended, timeout=15, what="no gated setup command is left running")
    code, _ = await run_command(two.stub, env.id, "true")
    assert code == 0
    assert (await ensure(two.stub, env.id)).status == READY
    assert await _setup_runs(sandbox_service, env.sandbox_id) == ["run", "run"]

    # The environment is deleted with its sandbox.
    await two.stub.DeleteEnvironment(pb.DeleteEnvironmentRequest(environment_id=env.id), metadata=md())
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await sandbox_service.stub.GetSandbox(sandbox_service_pb2.GetSandboxRequest(sandbox_id=env.sandbox_id), metadata=md())
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
