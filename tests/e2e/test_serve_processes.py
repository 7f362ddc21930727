"""`berth serve` runs each service in a process of its own under one
supervisor: the children serve the API together, SIGTERM to the supervisor
stops them all, and children whose supervisor was killed stop themselves."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from waiting import wait_until

_MODULES = {"services.sandbox", "services.environment", "services.session", "gateway"}


@dataclass
class Serve:
    process: subprocess.Popen[str]
    base_url: str
    key: str

    def children(self) -> dict[str, int]:
        """Module -> PID of each live child of the supervisor."""
        out: dict[str, int] = {}
        for pid in Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split():
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"-m" in argv:
                out[argv[argv.index(b"-m") + 1].decode()] = int(pid)
        return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@contextmanager
def berth_serve(data_dir: Path) -> Iterator[Serve]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BERTH_")}
    env.update(BERTH_DATA_DIR=str(data_dir), BERTH_GATEWAY_PORT="0", BERTH_LOG_LEVEL="WARNING")
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert process.stdout is not None
        lines: list[str] = []
        key = None
        while key is None:
            line = process.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
            key = re.search(r"sk-berth-[A-Za-z0-9_-]+", line)
        url = re.search(r"(http://\S+/v1)", "".join(lines))
        assert url, "".join(lines)
        yield Serve(process, url.group(1), key.group(0))
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=60)


async def _serves_the_api(serve: Serve) -> None:
    headers = {"Authorization": f"Bearer {serve.key}", "OpenAI-Beta": "agents=v1"}
    async with httpx.AsyncClient(base_url=serve.base_url, headers=headers, timeout=30) as http:
        created = await http.post("/agents/environments", json={"environment": {"type": "openai_hosted"}})
        assert created.status_code == 201
        listed = await http.get("/agents/sessions")
        assert listed.status_code == 200


async def test_serve_runs_each_service_in_its_own_process_and_sigterm_stops_them_all(
    tmp_path: Path, bwrap_available: None
) -> None:
    with berth_serve(tmp_path / "data") as serve:
        children = serve.children()
        assert set(children) == _MODULES
        # Each in a process group of its own: a terminal's Ctrl-C reaches the supervisor, which stops them in order.
        assert len({os.getpgid(pid) for pid in children.values()} | {os.getpgid(serve.process.pid)}) == 5
        await _serves_the_api(serve)
        serve.process.send_signal(signal.SIGTERM)
        assert serve.process.wait(timeout=60) == 0
        assert not [module for module, pid in children.items() if _alive(pid)]


async def test_children_of_a_killed_supervisor_stop_themselves(tmp_path: Path, bwrap_available: None) -> None:
    with berth_serve(tmp_path / "data") as serve:
        children = serve.children()
        assert set(children) == _MODULES
        serve.process.kill()
        serve.process.wait(timeout=10)
        await wait_until(
            lambda: not any(_alive(pid) for pid in children.values()), timeout=60, what="the orphaned children to stop"
        )
