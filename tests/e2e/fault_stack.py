"""The four services as separate processes on one PostgreSQL database, as an
operator runs them, each one killable with SIGKILL and restartable on its
address; and a bounded load of sessions, turns and live SSE consumers that
records what a client sees while they are killed.

``tests/e2e/test_fault_injection.py`` asserts on the report;
``bench/bench_faults.py`` prints its error rates and recovery times."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

__all__ = ["ProcessStack", "ServiceProcess", "FaultLoad", "LoadReport", "KillRecord", "SERVICES", "running_processes", "replay"]

# Started in this order (each needs the one before it); killed in any order.
SERVICES = ("sandbox", "environment", "session", "gateway")
_MODULES = {
    "sandbox": "services.sandbox",
    "environment": "services.environment",
    "session": "services.session",
    "gateway": "gateway",
}
_TERMINAL = ("agent.session.turn.completed", "agent.session.turn.failed", "agent.session.turn.cancelled")
# A client's pause between attempts at a service that did not answer.
_CLIENT_BACKOFF_S = 0.2
# How often the probing client reads.
_PROBE_INTERVAL_S = 0.1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class ServiceProcess:
    """One service's process; ``start`` again after ``kill`` restarts it on
    the same address."""

    name: str
    port: int
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, f"{self.name} is running"
        self._log = self._log or self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", _MODULES[self.name]],
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    async def ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not await asyncio.to_thread(_accepts, self.port):
            assert self.proc is not None and self.proc.poll() is None, (
                f"{self.name} exited with {self.proc and self.proc.returncode}: {self.log_tail()}"
            )
            assert time.monotonic() < deadline, f"{self.name} did not listen on {self.port}: {self.log_tail()}"
            await asyncio.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL, as a crash: no shutdown code runs."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class ProcessStack:
    data_dir: Path
    services: dict[str, ServiceProcess]
    key: str = ""

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.services['gateway'].port}/v1"

    def http(self) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {self.key}", "OpenAI-Beta": "agents=v1"}
        return httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=30)

    async def restart(self, name: str) -> None:
        self.services[name].start()
        await self.services[name].ready()


@contextlib.asynccontextmanager
async def running_processes(data_dir: Path, database_url: str, **settings: str) -> AsyncIterator[ProcessStack]:
    """Starts the four services, each its own process, all on ``database_url``
    (each service owns its tables), with an API key of a new organization."""
    data_dir.mkdir(parents=True, exist_ok=True)
    ports = {name: _free_port() for name in SERVICES}
    env = {
        **os.environ,
        "BERTH_DATA_DIR": str(data_dir),
        "BERTH_SANDBOX_ADDR": f"127.0.0.1:{ports['sandbox']}",
        "BERTH_ENVIRONMENT_ADDR": f"127.0.0.1:{ports['environment']}",
        "BERTH_SESSION_ADDR": f"127.0.0.1:{ports['session']}",
        "BERTH_GATEWAY_HOST": "127.0.0.1",
        "BERTH_GATEWAY_PORT": str(ports["gateway"]),
        "BERTH_SANDBOX_IDLE_PAUSE_S": "0",
        "BERTH_LOG_LEVEL": "WARNING",
        **{f"BERTH_{name.upper()}_DATABASE_URL": database_url for name in SERVICES},
        **{f"BERTH_{k.upper()}": v for k, v in settings.items()},
    }
    stack = ProcessStack(
        data_dir,
        {name: ServiceProcess(name, ports[name], env, data_dir / f"{name}.log") for name in SERVICES},
    )
    try:
        for name in SERVICES:
            await stack.restart(name)
        from gateway.keys import create_key, open_gateway_database
        from services.core.settings import Settings

        db = await open_gateway_database(Settings(gateway_database_url=database_url, data_dir=data_dir))
        try:
            _, stack.key = await create_key(db, "faults", ["tasks:read", "tasks:write"])
        finally:
            await db.dispose()
        yield stack
    finally:
        for name in reversed(SERVICES):
            stack.services[name].stop()


# --- the load ----------------------------------------------------------------------------


@dataclass
class KillRecord:
    """One service's kill: when, and how the clients' requests fared from
    then until the next kill (or the end of the load)."""

    service: str
    killed_at: float
    ready_at: float = 0.0
    # The last client request that failed in that window.
    last_error_at: float = 0.0
    requests: int = 0
    errors: int = 0

    @property
    def recovery_s(self) -> float:
        """From the kill to the last client-visible error it caused."""
        return max(0.0, self.last_error_at - self.killed_at) if self.last_error_at else 0.0

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


@dataclass
class _Follower:
    """A live SSE consumer of one session: reconnects with Last-Event-ID and
    checks that every event arrives once, in sequence."""

    session_id: str
    last_seq: int = 0
    event_ids: set[str] = field(default_factory=set)
    gaps: list[tuple[int, int]] = field(default_factory=list)
    duplicates: list[int] = field(default_factory=list)
    reconnects: int = 0
    ended: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def accept(self, seq: int, data: dict[str, Any]) -> None:
        if seq <= self.last_seq or data.get("event_id") in self.event_ids:
            self.duplicates.append(seq)
            return
        if seq != self.last_seq + 1:
            self.gaps.append((self.last_seq, seq))
        self.last_seq = seq
        self.event_ids.add(str(data.get("event_id")))
        if data.get("type") in _TERMINAL:
            turn = data["turn"]
            self.ended[str(turn["id"])] = str(turn["status"])
            if turn.get("error"):
                self.errors[str(turn["id"])] = f"{turn['error'].get('code')}: {turn['error'].get('message')}"
            self.changed.set()


@dataclass
class LoadReport:
    turns: dict[str, list[tuple[str, str]]]
    """Session -> (turn ID, final status or "stuck"), in order."""
    followers: list[_Follower]
    kills: list[KillRecord]
    environments: dict[str, str]
    requests: int = 0
    errors: int = 0

    @property
    def failed(self) -> list[tuple[str, str]]:
        """(turn ID, status and error) of each turn that did not complete."""
        errors = {t: e for f in self.followers for t, e in f.errors.items()}
        return [
            (t, f"{s} {errors.get(t, '')}") for turns in self.turns.values() for t, s in turns if s not in ("completed", "stuck")
        ]

    @property
    def stuck(self) -> list[str]:
        return [t for turns in self.turns.values() for t, s in turns if s == "stuck"]


class FaultLoad:
    """``sessions`` sessions, each with its own environment and a live SSE
    consumer, plus a client probing one session and its files, each running ``turns`` turns of ``$ echo N >> /workspace/log``
    one after another, while ``kill_order`` services are killed with SIGKILL
    one at a time (each once the load made progress since the last) and
    restarted at once."""

    def __init__(
        self,
        stack: ProcessStack,
        *,
        sessions: int,
        turns: int,
        kill_order: tuple[str, ...],
        turn_timeout_s: float = 90.0,
    ) -> None:
        self.stack = stack
        self.sessions = sessions
        self.turns = turns
        self.kill_order = kill_order
        self.turn_timeout_s = turn_timeout_s
        self.kills: list[KillRecord] = []
        self.requests = 0
        self.errors = 0
        self.completed = 0
        self.per_session: dict[str, int] = {}
        self._progress = asyncio.Event()

    def _record(self, ok: bool) -> None:
        self.requests += 1
        self.errors += 0 if ok else 1
        if self.kills:
            kill = self.kills[-1]
            kill.requests += 1
            if not ok:
                kill.errors += 1
                kill.last_error_at = time.monotonic()

    async def _request(self, http: httpx.AsyncClient, method: str, url: str, **kwargs: Any) -> httpx.Response:
        """A client request tried until the gateway answers with a status
        below 500; 5xx and connection errors count as client-visible errors."""
        while True:
            try:
                response = await http.request(method, url, **kwargs)
            except httpx.HTTPError:
                self._record(False)
            else:
                self._record(response.status_code < 500)
                if response.status_code < 500:
                    assert response.status_code < 400, (method, url, response.status_code, response.text)
                    return response
            await asyncio.sleep(_CLIENT_BACKOFF_S)

    async def _turn_ids(self, http: httpx.AsyncClient, session_id: str) -> list[str]:
        response = await self._request(http, "GET", f"/agents/sessions/{session_id}/turns", params={"order": "asc", "limit": 100})
        return [t["id"] for t in response.json()["data"]]

    async def _submit(self, http: httpx.AsyncClient, session_id: str, text: str, known: list[str]) -> str:
        """Submits one message and returns its turn. A submission whose
        answer was lost may still have been accepted: the turn list tells, so
        a retry never queues the same message twice."""
        body = {
            "events": [
                {"type": "agent.session.input.message", "input": [{"role": "user", "content": [{"type": "input_text", "text": text}]}]}
            ]
        }
        while True:
            accepted = False
            try:
                response = await http.post(f"/agents/sessions/{session_id}/events", json=body)
                accepted = response.status_code == 202
                self._record(response.status_code < 500)
                assert response.status_code < 400 or response.status_code >= 500, (response.status_code, response.text)
            except httpx.HTTPError:
                self._record(False)
            new = [t for t in await self._turn_ids(http, session_id) if t not in known]
            if new:
                assert len(new) == 1, new
                return new[0]
            assert not accepted, "an accepted message queued no turn"
            await asyncio.sleep(_CLIENT_BACKOFF_S)

    async def _follow(self, follower: _Follower, stop: asyncio.Event) -> None:
        async with self.stack.http() as http:
            while not stop.is_set():
                try:
                    headers = {"Accept": "text/event-stream", "Last-Event-ID": str(follower.last_seq)}
                    url = f"/agents/sessions/{follower.session_id}/events"
                    async with http.stream("GET", url, headers=headers, timeout=httpx.Timeout(30, read=None)) as response:
                        if response.status_code != 200:
                            raise httpx.HTTPError(f"status {response.status_code}")
                        fields: dict[str, list[str]] = {}
                        async for line in response.aiter_lines():
                            if line.startswith(":"):
                                continue
                            if line:
                                name, _, value = line.partition(":")
                                fields.setdefault(name, []).append(value[1:] if value.startswith(" ") else value)
                                continue
                            if "data" in fields and "id" in fields:
                                follower.accept(int(fields["id"][0]), json.loads("\n".join(fields["data"])))
                            fields = {}
                except (httpx.HTTPError, httpx.StreamError, ValueError):
                    pass
                if stop.is_set():
                    return
                follower.reconnects += 1
                await asyncio.sleep(_CLIENT_BACKOFF_S)

    async def _probe(self, session_id: str, environment_id: str, stop: asyncio.Event) -> None:
        """A client reading a session and its environment's files (through
        every service) on an interval, so every kill's error window shows."""
        async with self.stack.http() as http:
            urls = [f"/agents/sessions/{session_id}", f"/agents/environments/{environment_id}/files"]
            while not stop.is_set():
                for url in urls:
                    try:
                        response = await http.get(url, timeout=5)
                    except httpx.HTTPError:
                        self._record(False)
                    else:
                        self._record(response.status_code < 500)
                await asyncio.sleep(_PROBE_INTERVAL_S)

    async def _drive(self, session_id: str, follower: _Follower, out: list[tuple[str, str]]) -> None:
        async with self.stack.http() as http:
            known: list[str] = []
            for n in range(1, self.turns + 1):
                turn_id = await self._submit(http, session_id, f"$ echo {n} >> /workspace/log", known)
                known.append(turn_id)
                deadline = time.monotonic() + self.turn_timeout_s
                while turn_id not in follower.ended and time.monotonic() < deadline:
                    follower.changed.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(follower.changed.wait(), timeout=max(0.0, deadline - time.monotonic()))
                status = follower.ended.get(turn_id, "stuck")
                out.append((turn_id, status))
                if status == "stuck":
                    return
                self.completed += 1
                self.per_session[session_id] = n
                self._progress.set()

    async def _kill_each(self, done: asyncio.Event) -> None:
        """Kills once every session completed a turn (so setup is not what
        is interrupted), then again after each further share of the load."""
        total = self.sessions * self.turns
        step = max(1, (total - self.sessions) // (len(self.kill_order) + 1))
        for index, name in enumerate(self.kill_order):
            while not done.is_set() and (
                self.completed < self.sessions + step * index or min(self.per_session.values(), default=0) < 1
            ):
                self._progress.clear()
                await self._progress.wait()
            if done.is_set():
                return
            record = KillRecord(name, time.monotonic())
            self.kills.append(record)
            self.stack.services[name].kill()
            await self.stack.restart(name)
            record.ready_at = time.monotonic()

    async def run(self) -> LoadReport:
        environments: dict[str, str] = {}
        async with self.stack.http() as http:
            for _ in range(self.sessions):
                response = await self._request(
                    http, "POST", "/agents/sessions", json={"agent": {"model": "scripted"}, "environment": {"type": "openai_hosted"}}
                )
                environments[response.json()["id"]] = response.json()["environment"]["id"]
        followers = [_Follower(session_id) for session_id in environments]
        self.per_session = {f.session_id: 0 for f in followers}
        turns: dict[str, list[tuple[str, str]]] = {f.session_id: [] for f in followers}
        stop, done = asyncio.Event(), asyncio.Event()
        following = [asyncio.create_task(self._follow(f, stop)) for f in followers]
        first = followers[0].session_id
        following.append(asyncio.create_task(self._probe(first, environments[first], stop)))
        killer = asyncio.create_task(self._kill_each(done))
        try:
            await asyncio.gather(*(self._drive(f.session_id, f, turns[f.session_id]) for f in followers))
        finally:
            done.set()
            self._progress.set()
            await killer
            stop.set()
            for task in following:
                task.cancel()
            await asyncio.gather(*following, return_exceptions=True)
        return LoadReport(turns, followers, self.kills, environments, self.requests, self.errors)


async def replay(stack: ProcessStack, session_id: str, *, upto: int) -> list[tuple[int, dict[str, Any]]]:
    """The session's persisted log from the start (Last-Event-ID 0) up to
    sequence ``upto``, as (sequence, event) pairs."""
    out: list[tuple[int, dict[str, Any]]] = []
    async with stack.http() as http:
        headers = {"Accept": "text/event-stream", "Last-Event-ID": "0"}
        async with http.stream("GET", f"/agents/sessions/{session_id}/events", headers=headers) as response:
            assert response.status_code == 200, response.status_code
            fields: dict[str, list[str]] = {}
            async for line in response.aiter_lines():
                if line.startswith(":"):
                    continue
                if line:
                    name, _, value = line.partition(":")
                    fields.setdefault(name, []).append(value[1:] if value.startswith(" ") else value)
                    continue
                if "data" in fields and "id" in fields:
                    out.append((int(fields["id"][0]), json.loads("\n".join(fields["data"]))))
                    if out[-1][0] >= upto:
                        return out
                fields = {}
    return out
