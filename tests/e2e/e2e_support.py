"""Helpers the end-to-end tests share: Rebyte extensions called through the
official client, bounded waits, and a look at the sandboxes on the host."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import httpx
import openai
from openai.types.beta.agent_session import AgentSession
from openai.types.beta.agents.environment_info import EnvironmentInfo
from openai.types.beta.setup_command_param import SetupCommandParam
from openai.types.beta.agents.sessions.turn import Turn

BETA = {"OpenAI-Beta": "agents=v1"}
TERMINAL_TURN_EVENTS = ("agent.session.turn.completed", "agent.session.turn.failed", "agent.session.turn.cancelled")


def b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def setup_commands(*commands: str) -> list[SetupCommandParam]:
    return [{"command": c} for c in commands]


async def create_environment(client: openai.AsyncOpenAI, **config: Any) -> EnvironmentInfo:
    """A standalone environment through the SDK's ``environments.create``."""
    environment: Any = {"type": "openai_hosted", **config}
    return await client.beta.agents.environments.create(environment=environment)


async def delete_environment(client: openai.AsyncOpenAI, environment_id: str) -> dict[str, Any]:
    """``DELETE /agents/environments/{id}``: a Rebyte extension the SDK has no method for."""
    result: dict[str, Any] = await client.delete(
        f"/agents/environments/{environment_id}", cast_to=dict, options={"headers": BETA}
    )
    return result


async def attach_session(
    client: openai.AsyncOpenAI, environment_id: str, *, form: str = "reference", **body: Any
) -> AgentSession:
    """A session referencing an existing environment (``reference`` is a
    Rebyte extension the SDK's session input type does not include)."""
    payload = {
        "agent": {"model": "scripted"},
        "environment": {"type": form, "environment_id": environment_id},
        **body,
    }
    return await client.post("/agents/sessions", body=payload, cast_to=AgentSession, options={"headers": BETA})


async def inline_session(client: openai.AsyncOpenAI, **environment: Any) -> AgentSession:
    config: Any = {"type": "openai_hosted", **environment}
    session: AgentSession = await client.beta.agents.sessions.create(agent={"model": "scripted"}, environment=config)
    return session


def environment_of(session: AgentSession) -> str:
    env = session.environment
    assert env.type == "openai_hosted", env
    return env.id


async def send_script(client: openai.AsyncOpenAI, session_id: str, script: str) -> set[str]:
    """Sends one user message (a script for the ``scripted`` model); returns
    the IDs of the turns the session had before it."""
    known = {t.id async for t in client.beta.agents.sessions.turns.list(session_id)}
    await client.beta.agents.sessions.events.create(
        session_id,
        events=[
            {
                "type": "agent.session.input.message",
                "input": [{"role": "user", "content": [{"type": "input_text", "text": script}]}],
            }
        ],
    )
    return known


async def next_turn_end(client: openai.AsyncOpenAI, session_id: str, known: set[str], *, timeout: float = 30.0) -> Turn:
    """Follows the session's event stream until a turn not in ``known`` ends."""
    async with asyncio.timeout(timeout):
        # Last-Event-ID 0 replays the whole log; without it the stream is live
        # from now and could miss a turn that already ended.
        stream = await client.beta.agents.sessions.events.stream(session_id, extra_headers={"Last-Event-ID": "0"})
        async with stream:
            async for event in stream:
                if event.type in TERMINAL_TURN_EVENTS:
                    turn: Turn = event.turn  # type: ignore[union-attr]
                    if turn.id not in known:
                        return turn
    raise AssertionError("the event stream ended before the turn did")


async def run_script(client: openai.AsyncOpenAI, session_id: str, script: str, *, timeout: float = 30.0) -> Turn:
    """Runs one turn of the ``scripted`` model to its end."""
    known = await send_script(client, session_id, script)
    return await next_turn_end(client, session_id, known, timeout=timeout)


# --- the host's view of sandboxes --------------------------------------------------------


def sandboxes_root(data_dir: Path) -> Path:
    return data_dir / "sandboxes"


def sandbox_dirs(data_dir: Path) -> dict[str, Path]:
    """Environment ID -> its sandbox directory, for every sandbox that exists."""
    out: dict[str, Path] = {}
    root = sandboxes_root(data_dir)
    if not root.is_dir():
        return out
    for directory in root.iterdir():
        handle = directory / "run" / "handle.json"
        try:
            saved = json.loads(handle.read_text())
            labels = saved.get("private", {}).get("labels") or saved.get("labels") or {}
        except (OSError, ValueError):
            continue
        environment_id = labels.get("berth.environment_id")
        if environment_id:
            out[environment_id] = directory
    return out


def workspace_file(data_dir: Path, environment_id: str, path: str) -> Path:
    """The host path of ``/workspace/...`` in the environment's sandbox."""
    assert path.startswith("/workspace/"), path
    directory = sandbox_dirs(data_dir)[environment_id]
    return directory / "workspace" / path[len("/workspace/") :]


# --- errors -------------------------------------------------------------------------------


def assert_error(response: httpx.Response, status: int, code: str, *, param: str | None = None) -> dict[str, Any]:
    """The response is the OpenAI error envelope with this status and code."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == code, error
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


async def api_error(call: Awaitable[object]) -> openai.APIStatusError:
    """The SDK exception a call raises (it must raise one)."""
    try:
        await call
    except openai.APIStatusError as exc:
        return exc
    raise AssertionError("the call succeeded")
