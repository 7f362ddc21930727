"""``client.beta.agents.automations`` and ``automations.invocations`` through
the official SDK with strict response validation: every method, bad input
as a 400 naming its parameter, another organization's IDs as 404, scopes as
403, and the ``automations`` agent tool scheduling the model's follow-up.
Deliveries here are manual invocations, so no test waits for a due time
(the scheduler's timing is tested with an injected clock in
tests/session/test_automation_scheduler.py)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import pytest_asyncio
from e2e_stack import Stack, running_stack
from e2e_support import api_error, assert_error, run_script
from openai.types.beta.agents.automations.automation_invocation import AutomationInvocation
from openai.types.beta.agents.one_time_automation import OneTimeAutomation
from openai.types.beta.agents.periodic_automation import PeriodicAutomation
from waiting import wait_until

pytestmark = pytest.mark.asyncio(loop_scope="module")

NO_ENV: Any = {"type": "none"}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    async with running_stack(tmp_path_factory.mktemp("automations") / "berth") as s:
        yield s


def strict(stack: Stack, key: str | None = None) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=stack.base_url, api_key=key or stack.key, max_retries=0, _strict_response_validation=True
    )


def user(text: str) -> Any:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


async def idle_session(client: openai.AsyncOpenAI, **agent: Any) -> str:
    """A session without a turn. Its environment is never set up: the
    scripted turns here use no environment tool."""
    config: Any = {"model": "scripted", **agent}
    hosted: Any = {"type": "openai_hosted"}
    session = await client.beta.agents.sessions.create(agent=config, environment=hosted)
    return session.id


async def delivered(client: openai.AsyncOpenAI, automation_id: str, invocation_id: str) -> AutomationInvocation:
    async def done() -> AutomationInvocation | None:
        got = await client.beta.agents.automations.invocations.retrieve(invocation_id, automation_id=automation_id)
        return got if got.status != "queued" else None

    return await wait_until(done, 20.0, what=f"invocation {invocation_id} delivered")


async def user_texts(client: openai.AsyncOpenAI, session_id: str) -> list[str]:
    items = [i async for i in client.beta.agents.sessions.items.list(session_id, order="asc")]
    return [c.text for i in items if i.type == "message" and i.role == "user" for c in i.content if c.type == "input_text"]


async def test_every_automation_method_round_trips_through_the_sdk(stack: Stack) -> None:
    client = strict(stack)
    automations = client.beta.agents.automations
    session_id = await idle_session(client)

    periodic = await automations.create(
        type="periodic",
        name="morning",
        expression="0 9 * * *",
        timezone="Europe/Paris",
        target={"type": "existing_session", "session_id": session_id, "instructions": "say good morning"},
        metadata={"team": "a"},
    )
    assert isinstance(periodic, PeriodicAutomation)
    assert (periodic.status, periodic.created_by.type, periodic.pause_reason) == ("active", "developer", None)
    assert periodic.target.type == "existing_session" and periodic.target.session_id == session_id

    run_at = int(time.time()) + 3600
    once = await automations.create(
        type="once",
        name="later",
        run_at=run_at,
        target={"type": "new_session", "environment": NO_ENV, "agent": {"model": "scripted"}, "input": [user("hello from an automation")]},
    )
    assert isinstance(once, OneTimeAutomation)
    assert once.run_at == run_at and once.target.type == "new_session"
    assert once.target.agent is not None and once.target.agent.model == "scripted"
    assert once.target.environment.type == "none"

    assert await automations.retrieve(periodic.id) == periodic
    listed = [a.id async for a in automations.list(order="asc")]
    assert listed == [periodic.id, once.id]
    assert [a.id async for a in automations.list(session_id=session_id)] == [periodic.id]

    updated = await automations.update(periodic.id, name="evening", expression="0 18 * * 1-5", metadata={"team": "b"})
    assert isinstance(updated, PeriodicAutomation)
    assert (updated.name, updated.expression, updated.metadata, updated.timezone) == ("evening", "0 18 * * 1-5", {"team": "b"}, "Europe/Paris")
    moved = await automations.update(once.id, run_at=run_at + 60)
    assert isinstance(moved, OneTimeAutomation) and moved.run_at == run_at + 60

    paused = await automations.pause(periodic.id)
    assert paused.status == "paused"
    resumed = await automations.resume(periodic.id)
    assert resumed.status == "active"

    manual = await automations.invocations.create(periodic.id)
    assert (manual.automation_id, manual.source.type, manual.scheduled_at) == (periodic.id, "manual", None)
    done = await delivered(client, periodic.id, manual.id)
    assert (done.status, done.session_id, done.error) == ("completed", session_id, None)
    await wait_until(lambda: _has_text(client, session_id, "say good morning"), 20.0, what="instructions delivered")

    fresh = await delivered(client, once.id, (await automations.invocations.create(once.id)).id)
    assert fresh.status == "completed" and fresh.session_id and fresh.session_id != session_id
    assert (await client.beta.agents.sessions.retrieve(fresh.session_id)).id == fresh.session_id
    await wait_until(lambda: _has_text(client, fresh.session_id or "", "hello from an automation"), 20.0, what="new session input")

    page = [i.id async for i in automations.invocations.list(periodic.id)]
    assert page == [manual.id]
    assert (await automations.retrieve(once.id)).status == "active"  # a manual run leaves the schedule alone

    deleted = await automations.delete(periodic.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (periodic.id, True, "agent.automation.deleted")
    assert (await api_error(automations.retrieve(periodic.id))).status_code == 404
    assert (await api_error(automations.invocations.list(periodic.id))).status_code == 404


async def _has_text(client: openai.AsyncOpenAI, session_id: str, text: str) -> bool:
    return text in await user_texts(client, session_id)


async def test_a_deleted_target_session_fails_the_delivery_and_pauses_the_automation(stack: Stack) -> None:
    client = strict(stack)
    session_id = await idle_session(client)
    automation = await client.beta.agents.automations.create(
        type="periodic",
        name="orphan",
        expression="*/5 * * * *",
        timezone="UTC",
        target={"type": "existing_session", "session_id": session_id, "instructions": "ping"},
    )
    await client.beta.agents.sessions.delete(session_id)
    failed = await delivered(client, automation.id, (await client.beta.agents.automations.invocations.create(automation.id)).id)
    assert failed.status == "failed" and failed.error is not None and failed.error.code == "not_found"
    paused = await client.beta.agents.automations.retrieve(automation.id)
    assert (paused.status, paused.pause_reason) == ("paused", "target_session_failed")


async def test_the_model_schedules_its_own_follow_up_with_the_automations_tool(stack: Stack) -> None:
    client = strict(stack)
    session_id = await idle_session(client, tools=[{"type": "automations"}])
    turn = await run_script(client, session_id, 'automation {"instructions": "follow up on the build", "delay_seconds": 3600}\nscheduled')
    assert turn.status == "completed"

    (created,) = [a async for a in client.beta.agents.automations.list(session_id=session_id)]
    assert isinstance(created, OneTimeAutomation)
    assert created.created_by.type == "agent" and created.created_by.session_id == session_id
    assert created.created_by.tool_call_id
    assert created.target.type == "existing_session" and created.target.instructions == "follow up on the build"
    assert created.run_at > time.time() + 3000

    await delivered(client, created.id, (await client.beta.agents.automations.invocations.create(created.id)).id)
    await wait_until(lambda: _has_text(client, session_id, "follow up on the build"), 20.0, what="follow-up delivered")

    # An agent-created automation keeps its creator session as its target.
    other = await idle_session(client)
    error = await api_error(
        client.beta.agents.automations.update(
            created.id, target={"type": "existing_session", "session_id": other, "instructions": "elsewhere"}
        )
    )
    assert (error.status_code, error.code, error.param) == (400, "validation_error", "target.session_id")


async def test_a_tool_call_the_service_refuses_is_an_error_the_model_sees(stack: Stack) -> None:
    client = strict(stack)
    session_id = await idle_session(client, tools=[{"type": "automations"}])
    turn = await run_script(client, session_id, 'automation {"instructions": "x", "expression": "not cron"}\ndone')
    assert turn.status == "completed"
    assert [a async for a in client.beta.agents.automations.list(session_id=session_id)] == []


BAD_CREATES: list[tuple[dict[str, Any], str]] = [
    ({"type": "periodic", "name": "n", "expression": "61 * * * *", "timezone": "UTC"}, "expression"),
    ({"type": "periodic", "name": "n", "expression": "* * * *", "timezone": "UTC"}, "expression"),
    ({"type": "periodic", "name": "n", "expression": "* * * * *", "timezone": "Mars/Olympus"}, "timezone"),
    ({"type": "once", "name": "n", "run_at": 1_000_000}, "run_at"),
    ({"type": "once", "name": "n", "run_at": "soon"}, "run_at"),
    # Beyond int64 (schemathesis found this one a 500).
    ({"type": "once", "name": "n", "run_at": 267434217258522738688}, "run_at"),
    ({"type": "once", "name": "n", "run_at": 253_402_300_800}, "run_at"),
    ({"type": "weekly", "name": "n"}, "type"),
    ({"type": "once", "name": "", "run_at": 4_000_000_000}, "name"),
    ({"type": "once", "name": "n", "run_at": 4_000_000_000, "colour": "red"}, "colour"),
]


@pytest.mark.parametrize(("body", "param"), BAD_CREATES)
async def test_bad_automation_input_is_a_400_naming_the_parameter(stack: Stack, body: dict[str, Any], param: str) -> None:
    client = strict(stack)
    session_id = await idle_session(client)
    body = {"target": {"type": "existing_session", "session_id": session_id, "instructions": "i"}, **body}
    async with stack.http() as http:
        assert_error(await http.post("/agents/automations", json=body), 400, "validation_error", param=param)
        assert (await http.get("/agents/automations", params={"session_id": session_id})).json()["data"] == []


async def test_bad_targets_and_updates_are_refused_and_write_nothing(stack: Stack) -> None:
    client = strict(stack)
    automations = client.beta.agents.automations
    session_id = await idle_session(client)
    existing: Any = {"type": "existing_session", "session_id": session_id, "instructions": "i"}
    async with stack.http() as http:
        no_input = {"type": "new_session", "environment": NO_ENV, "agent": {"model": "scripted"}, "input": []}
        assert_error(
            await http.post("/agents/automations", json={"type": "once", "name": "n", "run_at": 4_000_000_000, "target": no_input}),
            400,
            "validation_error",
            param="target.input",
        )
        no_model = {"type": "new_session", "environment": NO_ENV, "input": [user("x")]}
        assert_error(
            await http.post("/agents/automations", json={"type": "once", "name": "n", "run_at": 4_000_000_000, "target": no_model}),
            400,
            "validation_error",
            param="target.agent.model",
        )
    once = await automations.create(type="once", name="n", run_at=4_000_000_000, target=existing)
    for kwargs, param in (
        ({"expression": "* * * * *"}, "expression"),
        ({"run_at": 1}, "run_at"),
        ({"run_at": 2**63}, "run_at"),
        ({"target": {"type": "new_session", "environment": NO_ENV, "agent": {"model": "scripted"}, "input": [user("x")]}}, "target.type"),
    ):
        error = await api_error(automations.update(once.id, **kwargs))
        assert (error.status_code, error.code, error.param) == (400, "validation_error", param)
    assert await automations.retrieve(once.id) == once
    [invocation] = [
        await delivered(client, once.id, (await automations.invocations.create(once.id)).id)
    ]
    assert invocation.status == "completed"


async def test_automation_paths_are_never_read_as_agent_ids(stack: Stack) -> None:
    async with stack.http() as http:
        listed = await http.get("/agents/automations")
        assert listed.status_code == 200 and listed.json()["object"] == "list"
        assert_error(await http.get("/agents/automations/auto_missing"), 404, "not_found")
        assert_error(await http.post("/agents/automations/auto_missing/pause"), 404, "not_found")
        assert_error(await http.get("/agents/automations/auto_missing/invocations"), 404, "not_found")


async def test_another_organizations_automations_are_404_and_scopes_are_403(stack: Stack) -> None:
    client = strict(stack)
    session_id = await idle_session(client)
    target: Any = {"type": "existing_session", "session_id": session_id, "instructions": "i"}
    automation = await client.beta.agents.automations.create(type="once", name="mine", run_at=4_000_000_000, target=target)
    invocation = await client.beta.agents.automations.invocations.create(automation.id)
    agent = await client.beta.agents.create(model="scripted")
    ids = {"auto": automation.id, "inv": invocation.id, "sess": session_id}
    routes: list[tuple[str, str, dict[str, Any] | None]] = [
        ("GET", "/agents/automations/{auto}", None),
        ("POST", "/agents/automations/{auto}", {"name": "stolen"}),
        ("DELETE", "/agents/automations/{auto}", None),
        ("POST", "/agents/automations/{auto}/pause", None),
        ("POST", "/agents/automations/{auto}/resume", None),
        ("POST", "/agents/automations/{auto}/invocations", None),
        ("GET", "/agents/automations/{auto}/invocations", None),
        ("GET", "/agents/automations/{auto}/invocations/{inv}", None),
    ]
    foreign_creates = [
        {"type": "once", "name": "x", "run_at": 4_000_000_000, "target": target},
        {
            "type": "once",
            "name": "x",
            "run_at": 4_000_000_000,
            "target": {"type": "new_session", "environment": NO_ENV, "agent_id": agent.id, "input": [user("x")]},
        },
    ]
    other = await stack.new_key("org-b")
    reader = await stack.new_key("org-a", ("tasks:read",))
    writer = await stack.new_key("org-a", ("tasks:write",))
    async with stack.http(other) as http:
        for method, template, body in routes:
            assert_error(await http.request(method, template.format(**ids), json=body), 404, "not_found")
        for body in foreign_creates:
            assert_error(await http.post("/agents/automations", json=body), 404, "not_found")
        assert_error(await http.get("/agents/automations", params={"session_id": session_id}), 404, "not_found")
        assert (await http.get("/agents/automations")).json()["data"] == []
    async with stack.http(reader) as http:
        for method, template, body in routes:
            if method != "GET":
                assert_error(await http.request(method, template.format(**ids), json=body), 403, "insufficient_scopes")
        assert_error(await http.post("/agents/automations", json=foreign_creates[0]), 403, "insufficient_scopes")
    async with stack.http(writer) as http:
        for method, template, body in routes:
            if method == "GET":
                assert_error(await http.request(method, template.format(**ids), json=body), 403, "insufficient_scopes")
        assert_error(await http.get("/agents/automations"), 403, "insufficient_scopes")
    # Untouched: still there, still named, one invocation.
    assert (await client.beta.agents.automations.retrieve(automation.id)).name == "mine"
    assert [i.id async for i in client.beta.agents.automations.invocations.list(automation.id)] == [invocation.id]
