"""A setup killed mid-way completes after its service restarts (issue 13).

The Environment service runs as a process of its own, on SQLite; the
Sandbox service, the Session service and the gateway run in-process. The
test starts an environment's setup through the public API, SIGKILLs the
Environment service while the second of three setup commands blocks (on a
file the test creates), and starts the service again on the same address.
Once the dead owner's lease expires the new process takes setup over with
nobody waiting for it, reuses the sandbox, runs the interrupted command
again, and finishes: the environment is ``ready`` and the first command ran
once."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from e2e_stack import destroy_sandboxes
from e2e_support import BETA, sandbox_dirs, setup_commands, workspace_file
from hosts_support import free_port
from service_processes import spawn_service, stop_process, wait_serving
from waiting import wait_until

from gateway.app import start_gateway
from gateway.keys import create_key
from services.core.settings import Settings
from services.sandbox.server import start_sandbox_service
from services.session.server import start_session_service

pytestmark = [pytest.mark.timeout(180)]

LEASE_S = 1.5
FIRST = "echo first >> /workspace/steps"
GATED = "echo run >> /workspace/runs; while [ ! -e /workspace/release ]; do sleep 0.05; done"
LAST = "echo last >> /workspace/steps"


@dataclass
class Harness:
    data_dir: Path
    environment_addr: str
    sandbox_addr: str
    base_url: str = ""
    key: str = ""
    process: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.data_dir / "environment.log"

    async def start_environment(self) -> None:
        self.process = spawn_service(
            "services.environment",
            self.log_path,
            environment_addr=self.environment_addr,
            sandbox_addr=self.sandbox_addr,
            data_dir=str(self.data_dir),
            init_lease_s=str(LEASE_S),
            rpc_timeout_s="10",
        )
        await wait_serving(self.environment_addr, self.log_path, what="the Environment service")

    async def kill_environment(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        await asyncio.to_thread(self.process.wait, 10)


@pytest.fixture
async def harness(tmp_path: Path, bwrap_available: None) -> AsyncIterator[Harness]:
    data_dir = tmp_path / "berth"
    data_dir.mkdir()
    settings = Settings(data_dir=data_dir, sandbox_idle_pause_s=0, init_lease_s=LEASE_S)
    sandbox = await start_sandbox_service(settings, address="127.0.0.1:0")
    environment_addr = f"127.0.0.1:{free_port()}"
    settings = settings.model_copy(update={"sandbox_addr": sandbox.address, "environment_addr": environment_addr})
    h = Harness(data_dir, environment_addr, sandbox.address)
    session = gateway = None
    try:
        await h.start_environment()
        session = await start_session_service(settings, address="127.0.0.1:0")
        settings = settings.model_copy(update={"session_addr": session.address})
        gateway = await start_gateway(settings, port=0)
        _, h.key = await create_key(gateway.database, "org-a", ["tasks:read", "tasks:write"])
        h.base_url = f"http://127.0.0.1:{gateway.port}/v1"
        yield h
    finally:
        if h.process is not None:
            await stop_process(h.process)
        if gateway is not None:
            await gateway.stop()
        if session is not None:
            await session.stop(0.5)
        await destroy_sandboxes(data_dir)
        await sandbox.stop(0.5)


def lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except FileNotFoundError:
        return []


async def test_a_setup_killed_mid_way_completes_after_a_restart_without_rerunning_earlier_steps(harness: Harness) -> None:
    headers = {"Authorization": f"Bearer {harness.key}", **BETA}
    async with httpx.AsyncClient(base_url=harness.base_url, headers=headers, timeout=30) as http:
        created = await http.post(
            "/agents/environments",
            json={"environment": {"type": "openai_hosted", "setup_commands": setup_commands(FIRST, GATED, LAST)}},
        )
        assert created.status_code == 201, created.text
        env_id = created.json()["id"]

        # The first operation on the environment runs setup; it blocks in the gated command.
        first_use = asyncio.ensure_future(
            http.post(f"/agents/environments/{env_id}/files", json={"type": "inline", "path": "/workspace/a.txt", "data": "YQ=="})
        )

        def runs() -> list[str]:
            if env_id not in sandbox_dirs(harness.data_dir):
                return []
            return lines(workspace_file(harness.data_dir, env_id, "/workspace/runs"))

        def started() -> bool:
            if first_use.done():
                pytest.fail(f"the first operation ended before setup blocked: {first_use.result().text}")
            return runs() == ["run"]

        await wait_until(started, timeout=60, what="the gated setup command started")
        sandbox_dir = sandbox_dirs(harness.data_dir)[env_id]
        assert not first_use.done()

        await harness.kill_environment()
        answer = await asyncio.wait_for(first_use, 30)
        assert answer.status_code == 503, answer.text
        await harness.start_environment()

        # Nobody waits: the restarted process takes the setup over once the
        # dead owner's lease expires, and runs the interrupted command again.
        await wait_until(lambda: runs() == ["run", "run"], timeout=30, what="the interrupted command ran again")
        # Setup is still running (the public API shows it as pending), not failed.
        assert (await http.get(f"/agents/environments/{env_id}")).json()["status"] == "pending"
        workspace_file(harness.data_dir, env_id, "/workspace/release").write_bytes(b"")

        async def ready() -> bool:
            response = await http.get(f"/agents/environments/{env_id}")
            assert response.status_code == 200, response.text
            return bool(response.json()["status"] == "ready")

        await wait_until(ready, timeout=30, what="the environment became ready after the restart")
        # The same sandbox, and the earlier command ran once.
        assert sandbox_dirs(harness.data_dir) == {env_id: sandbox_dir}
        assert lines(workspace_file(harness.data_dir, env_id, "/workspace/steps")) == ["first", "last"]
        assert runs() == ["run", "run"]

        written = await http.post(f"/agents/environments/{env_id}/files", json={"type": "inline", "path": "/workspace/a.txt", "data": "YQ=="})
        assert written.status_code == 200, written.text
        deleted = await http.delete(f"/agents/environments/{env_id}")
        assert deleted.status_code == 200, deleted.text
