"""The fake model server (``tests/fake_model.py``) in a process of its own,
for benchmarks that time the harness against it: in the benchmark's process
its thread would share the GIL with the code it times.

The child serves the model with keep-alive and ``TCP_NODELAY`` on one port
and a control API on another (JSON over HTTP, 127.0.0.1 only):

- ``POST /script`` ``{"answers": [{"text"?, "tool_calls"?, "hold"?}]}`` sets
  the replies of the next requests; a held answer stops after its first
  text chunk until ``POST /release``;
- ``GET /requests?start=N`` lists the requests from the N-th on, each with
  its ``received_at``, ``answered_at`` and ``first_text_at`` (monotonic
  seconds: the clock is the machine's, so they compare with the parent's).

    async with RemoteModel.start() as model:
        await model.script([{"tool_calls": [["exec_command", "{}"]]}])
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import httpx

_TESTS = Path(__file__).resolve().parent.parent / "tests"

__all__ = ["RemoteModel", "Timing"]


@dataclass(frozen=True)
class Timing:
    received_at: float
    answered_at: float
    first_text_at: float


class RemoteModel:
    """The parent's handle on the child process."""

    def __init__(self, base_url: str, control_url: str) -> None:
        self.base_url = base_url
        self._control = httpx.AsyncClient(base_url=control_url, timeout=30)

    @classmethod
    @asynccontextmanager
    async def start(cls) -> AsyncIterator[RemoteModel]:
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.model_process", stdout=asyncio.subprocess.PIPE, cwd=str(_TESTS.parent)
        )
        assert child.stdout is not None
        try:
            line = await asyncio.wait_for(child.stdout.readline(), 30)
            ports = json.loads(line)
            model = cls(f"http://127.0.0.1:{ports['model']}/v1", f"http://127.0.0.1:{ports['control']}")
            try:
                yield model
            finally:
                await model._control.aclose()
        finally:
            if child.returncode is None:
                child.terminate()
            await child.wait()

    async def script(self, answers: list[dict[str, Any]]) -> None:
        (await self._control.post("/script", json={"answers": answers})).raise_for_status()

    async def release(self) -> None:
        (await self._control.post("/release")).raise_for_status()

    async def requests(self, start: int = 0) -> list[Timing]:
        response = await self._control.get("/requests", params={"start": start})
        response.raise_for_status()
        return [Timing(**entry) for entry in response.json()]

    async def count(self) -> int:
        return len(await self.requests())


def _serve() -> None:
    sys.path.insert(0, str(_TESTS))
    from fake_model import Answer, FakeModel, NoDelayHandler

    hold = threading.Event()
    with FakeModel(keep_alive=True) as model:

        class Control(NoDelayHandler):

            def _reply(self, payload: object) -> None:
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:  # noqa: N802 - the stdlib's naming
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if self.path == "/script":
                    hold.clear()
                    model.script = [
                        Answer(
                            text=entry.get("text"),
                            tool_calls=[(name, arguments) for name, arguments in entry.get("tool_calls", [])],
                            hold=hold if entry.get("hold") else None,
                        )
                        for entry in body["answers"]
                    ]
                elif self.path == "/release":
                    hold.set()
                self._reply({})

            def do_GET(self) -> None:  # noqa: N802
                start = int(parse_qs(urlparse(self.path).query).get("start", ["0"])[0])
                self._reply(
                    [
                        {"received_at": r.received_at, "answered_at": r.answered_at, "first_text_at": r.first_text_at}
                        for r in model.requests[start:]
                    ]
                )

        control = ThreadingHTTPServer(("127.0.0.1", 0), Control)
        print(json.dumps({"model": model.port, "control": control.server_address[1]}), flush=True)
        control.serve_forever()


if __name__ == "__main__":
    _serve()
