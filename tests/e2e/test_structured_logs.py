"""Structured logs name what they are about: during a scripted turn on the
in-process stack, the Session service logs lines carrying the organization,
session, environment and turn IDs, and the Environment service lines
carrying the organization and environment IDs."""

from __future__ import annotations

import io
import json
from typing import Any

from e2e_stack import Stack
from e2e_support import environment_of, inline_session, run_script

from services.core.logging import capture_json_logs


def _lines(stream: io.StringIO) -> list[dict[str, Any]]:
    out = []
    for raw in stream.getvalue().splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if isinstance(line, dict):
            out.append(line)
    return out


async def test_log_lines_of_a_turn_carry_the_org_session_environment_and_turn_ids(stack: Stack) -> None:
    client = stack.aclient()
    stream = io.StringIO()
    with capture_json_logs(stream):
        session = await inline_session(client)
        environment_id = environment_of(session)
        turn = await run_script(client, session.id, "$ echo hello")
    assert turn.status == "completed"
    lines = _lines(stream)
    assert lines, "no JSON log lines were captured"

    def about_the_turn(line: dict[str, Any]) -> bool:
        return (
            bool(line.get("org_id"))
            and line.get("session_id") == session.id
            and line.get("environment_id") == environment_id
            and line.get("turn_id") == turn.id
        )

    session_lines = [line for line in lines if str(line.get("logger", "")).startswith("services.session")]
    assert any(about_the_turn(line) for line in session_lines), [
        (line.get("event"), sorted(line)) for line in session_lines
    ]
    environment_lines = [line for line in lines if str(line.get("logger", "")).startswith("services.environment")]
    assert any(
        line.get("org_id") and line.get("environment_id") == environment_id for line in environment_lines
    ), [(line.get("event"), sorted(line)) for line in environment_lines]
