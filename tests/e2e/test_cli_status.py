"""`berth status` reports the health of each of the four services."""

from __future__ import annotations

import asyncio

import pytest
from e2e_stack import Stack

from services import cli


def _status_env(monkeypatch: pytest.MonkeyPatch, stack: object, gateway_port: int) -> None:
    settings = stack.settings  # type: ignore[attr-defined]
    monkeypatch.setenv("BERTH_GATEWAY_HOST", "127.0.0.1")
    monkeypatch.setenv("BERTH_GATEWAY_PORT", str(gateway_port))
    monkeypatch.setenv("BERTH_SESSION_ADDR", settings.session_addr)
    monkeypatch.setenv("BERTH_ENVIRONMENT_ADDR", settings.environment_addr)
    monkeypatch.setenv("BERTH_SANDBOX_ADDR", settings.sandbox_addr)


async def test_status_reports_every_service_serving(stack: Stack, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    port = int(stack.base_url.rsplit(":", 1)[1].split("/", 1)[0])
    _status_env(monkeypatch, stack, port)
    code = await asyncio.to_thread(cli.main, ["status"])
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert {"gateway", "session", "environment", "sandbox"} <= set(lines)
    assert all(lines[name].rstrip().endswith("SERVING") for name in ("gateway", "session", "environment", "sandbox"))
    assert code == 0


async def test_status_fails_when_a_service_is_down(stack: Stack, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    port = int(stack.base_url.rsplit(":", 1)[1].split("/", 1)[0])
    _status_env(monkeypatch, stack, port)
    await stack.stop_sandbox()
    try:
        code = await asyncio.to_thread(cli.main, ["status"])
    finally:
        await stack.start_sandbox()
    out = capsys.readouterr().out
    sandbox_line = next(line for line in out.splitlines() if line.startswith("sandbox"))
    assert "unreachable" in sandbox_line
    assert code == 1
