"""Inputs a careless or hostile client sends, over every route that takes
them: each is a 4xx with the OpenAI error envelope, the keep-alive
connection survives it, and nothing is written (issue 13, deliverable 3)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from e2e_stack import Stack, start_stack
from e2e_support import assert_error, create_environment, sandbox_dirs

from gateway.validation import MAX_JSON_DEPTH
from services.core.workspace_limits import MAX_PATH_DEPTH

HOSTED = {"type": "openai_hosted"}
SCRIPTED = {"model": "scripted"}


def _message(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "input_text", "text": text}]}]


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _deep(objects: int) -> str:
    """``objects`` JSON objects, each inside the last."""
    return '{"a":' * (objects - 1) + '{"a":1' + "}" * objects


def _tool(parameters: str) -> str:
    return '{"type": "function", "name": "f", "description": "d", "parameters": ' + parameters + "}"


def _schema_text(schema: str) -> str:
    return '{"format": {"type": "json_schema", "name": "out", "schema": ' + schema + "}}"


# Raw JSON bodies, each wrong in one way the parser must refuse, with the
# code and param of the refusal (the parser runs before any route's model).
RAW_BODIES: list[tuple[str, str, str, str | None]] = [
    ("nested 1,000 levels deep", '{"model": "scripted", "metadata": ' + _nested(1000).decode() + "}", "invalid_json", None),
    ("nested 100,000 levels deep", '{"model": "scripted", "metadata": ' + _nested(100_000).decode() + "}", "invalid_json", None),
    # parameters is the fourth container (body, tools, tool, parameters).
    ("nested one level past the limit", '{"model": "scripted", "tools": [' + _tool(_deep(MAX_JSON_DEPTH - 3 + 1)) + "]}", "invalid_json", None),
    ("an integer literal of 5,000 digits", '{"model": "scripted", "tools": [' + _tool('{"maximum": ' + "9" * 5000 + "}") + "]}", "invalid_json", None),
    ("NaN in tools[].parameters", '{"model": "scripted", "tools": [' + _tool('{"maximum": NaN}') + "]}", "invalid_json", None),
    ("Infinity in tools[].parameters", '{"model": "scripted", "tools": [' + _tool('{"maximum": Infinity}') + "]}", "invalid_json", None),
    ("-Infinity in text.format.schema", '{"model": "scripted", "text": ' + _schema_text('{"minimum": -Infinity}') + "}", "invalid_json", None),
    ("a float that overflows to infinity", '{"model": "scripted", "text": ' + _schema_text('{"minimum": 1e400}') + "}", "invalid_json", None),
    ("a lone surrogate in the name", '{"model": "scripted", "name": "\\ud800"}', "invalid_json", "name"),
    ("a lone surrogate in a key", '{"model": "scripted", "metadata": {"\\udfff": "v"}}', "invalid_json", "metadata"),
    ("NUL in the name", '{"model": "scripted", "name": "a\\u0000b"}', "validation_error", "name"),
    ("NUL in instructions", '{"model": "scripted", "instructions": "\\u0000"}', "validation_error", "instructions"),
]


async def everything(http: httpx.AsyncClient, session_id: str | None = None) -> dict[str, Any]:
    """What exists in the organization (and in one session)."""
    out: dict[str, Any] = {}
    for path in ("/agents/environments", "/agents/sessions", "/agents", "/files"):
        response = await http.get(path, params={"limit": 100})
        assert response.status_code == 200, response.text
        out[path] = [(item["id"], item.get("updated_at"), item.get("name"), item.get("metadata")) for item in response.json()["data"]]
    if session_id is not None:
        for sub in ("turns", "items"):
            response = await http.get(f"/agents/sessions/{session_id}/{sub}", params={"limit": 100})
            assert response.status_code == 200, response.text
            out[sub] = [item["id"] for item in response.json()["data"]]
    return out


def assert_rejected(response: httpx.Response, name: str) -> dict[str, Any]:
    """A 4xx in the error envelope that leaves the connection open."""
    assert 400 <= response.status_code < 500, (name, response.status_code, response.text)
    error = assert_error(response, response.status_code, response.json()["error"]["code"])
    assert error["type"] and error["code"], (name, error)
    assert response.headers.get("connection", "").lower() != "close", name
    return error


@pytest.fixture
async def postgres_stack(tmp_path: Path, bwrap_available: None, postgres_database: str) -> AsyncIterator[Stack]:
    """The stack with the Session service (agents, sessions) on PostgreSQL."""
    conn = await asyncpg.connect(postgres_database, timeout=3)
    try:
        await conn.execute("DROP SCHEMA IF EXISTS public CASCADE; CREATE SCHEMA public;")
    finally:
        await conn.close()
    s, stop = await start_stack(tmp_path / "berth", session_database_url=postgres_database)
    try:
        yield s
    finally:
        await stop()  # type: ignore[misc]


async def _json_routes(stack: Stack) -> tuple[list[str], str]:
    """Every route that takes a JSON body, with real IDs; and the session's ID."""
    client = stack.aclient()
    agent = await client.beta.agents.create(model="scripted", name="kept")
    env = await create_environment(client)
    async with stack.http() as http:
        created = await http.post("/agents/sessions", json={"agent_id": agent.id, "environment": {"type": "reference", "environment_id": env.id}})
        assert created.status_code in (200, 201), created.text
    session_id = created.json()["id"]
    routes = [
        "/agents",
        f"/agents/{agent.id}",
        "/agents/environments",
        f"/agents/environments/{env.id}/files",
        "/agents/sessions",
        f"/agents/sessions/{session_id}",
        f"/agents/sessions/{session_id}/events",
    ]
    return routes, session_id


async def _assert_raw_bodies_rejected(stack: Stack) -> None:
    routes, session_id = await _json_routes(stack)
    async with stack.http() as http:
        before = await everything(http, session_id)
        for route in routes:
            for name, body, code, param in RAW_BODIES:
                response = await http.post(route, content=body.encode(), headers={"content-type": "application/json"})
                error = assert_rejected(response, f"{route}: {name}")
                assert (response.status_code, error["code"], error["param"]) == (400, code, param), (route, name, error)
        assert await everything(http, session_id) == before
    assert len(sandbox_dirs(stack.data_dir)) <= 1


async def test_unparseable_or_unstorable_json_is_a_400_on_every_route_and_writes_nothing(stack: Stack) -> None:
    await _assert_raw_bodies_rejected(stack)


@pytest.mark.postgres
async def test_nul_and_lone_surrogates_are_400s_on_postgresql_too(postgres_stack: Stack) -> None:
    await _assert_raw_bodies_rejected(postgres_stack)


async def test_json_at_the_depth_limit_and_wide_integers_within_the_bound_are_stored_and_served(stack: Stack) -> None:
    parameters = _deep(MAX_JSON_DEPTH - 3)[:-1] + ', "maximum": 123456789012345678901234567890}'
    agent_body = '{"model": "scripted", "tools": [' + _tool(parameters) + "]}"
    # Inline in a session the tools sit one level deeper.
    inline_agent = '{"model": "scripted", "tools": [' + _tool(_deep(MAX_JSON_DEPTH - 4)) + "]}"
    session_body = '{"environment": {"type": "openai_hosted"}, "agent": ' + inline_agent + "}"
    async with stack.http() as http:
        created = await http.post("/agents", content=agent_body.encode(), headers={"content-type": "application/json"})
        assert created.status_code in (200, 201), created.text
        fetched = await http.get(f"/agents/{created.json()['id']}")
        assert fetched.status_code == 200, fetched.text
        stored = fetched.json()["tools"][0]["parameters"]
        # Struct numbers are doubles: the wide literal is kept as its float.
        assert stored["maximum"] == float(123456789012345678901234567890)
        for _ in range(MAX_JSON_DEPTH - 4):
            stored = stored["a"]
        assert stored == {"a": 1}
        session = await http.post("/agents/sessions", content=session_body.encode(), headers={"content-type": "application/json"})
        assert session.status_code in (200, 201), session.text
        got = await http.get(f"/agents/sessions/{session.json()['id']}")
        assert got.status_code == 200, got.text


# Bodies valid JSON but mistyped, per route kind, with the param named.
# "agent", "agent_update", "environment", "file", "session", "session_update"
# and "events" stand for the routes of _json_routes, in that order.
TYPED_BODIES: list[tuple[str, str, dict[str, Any], str]] = [
    ("stream as a string", "session", {"agent": SCRIPTED, "environment": HOSTED, "input": "hi", "stream": "yes"}, "stream"),
    ("stream as a number", "session", {"agent": SCRIPTED, "environment": HOSTED, "input": "hi", "stream": 1}, "stream"),
    (
        "include_obfuscation as a string",
        "session",
        {"agent": SCRIPTED, "environment": HOSTED, "input": "hi", "stream": True, "stream_options": {"include_obfuscation": "no"}},
        "stream_options.include_obfuscation",
    ),
    ("multi_agent.enabled as a number", "agent", {**SCRIPTED, "multi_agent": {"enabled": 1}}, "multi_agent.enabled"),
    (
        "max_concurrent_subagents as a string",
        "agent",
        {**SCRIPTED, "multi_agent": {"enabled": True, "max_concurrent_subagents": "3"}},
        "multi_agent.max_concurrent_subagents",
    ),
    (
        "max_concurrent_subagents beyond int32",
        "agent_update",
        {"multi_agent": {"enabled": True, "max_concurrent_subagents": 2**31}},
        "multi_agent.max_concurrent_subagents",
    ),
    (
        "defer_loading as a string",
        "agent",
        {**SCRIPTED, "tools": [{"type": "function", "name": "f", "description": "d", "parameters": {}, "defer_loading": "true"}]},
        "tools.0.defer_loading",
    ),
    ("time_awareness as a string", "agent_update", {"experimental": {"time_awareness": "false"}}, "experimental.time_awareness"),
    ("desktop.enabled as a string", "environment", {"environment": {**HOSTED, "desktop": {"enabled": "false"}}}, "environment.desktop.enabled"),
    ("an inline file path as a number", "file", {"type": "inline", "path": 7, "data": ""}, "path"),
    ("metadata values as numbers", "session_update", {"metadata": {"k": 1}}, "metadata.k"),
    (
        "tool_result success as a string",
        "events",
        {"events": [{"type": "agent.session.input.tool_result", "turn_id": "turn_x", "call_id": "c", "success": "true"}]},
        "events.0.success",
    ),
]

_KINDS = ("agent", "agent_update", "environment", "file", "session", "session_update", "events")


async def test_mistyped_scalars_are_400s_naming_their_param_and_write_nothing(stack: Stack) -> None:
    routes, session_id = await _json_routes(stack)
    by_kind = dict(zip(_KINDS, routes, strict=True))
    by_kind["session"] = "/agents/sessions"
    async with stack.http() as http:
        before = await everything(http, session_id)
        for name, kind, body, param in TYPED_BODIES:
            error = assert_rejected(await http.post(by_kind[kind], json=body), name)
            assert (error["code"], error["param"]) == ("validation_error", param), (name, error)
        assert await everything(http, session_id) == before


BAD_LAST_EVENT_IDS = ["9223372036854775808", "99999999999999999999999999", "-1", "1_000", "\u0663", "abc", "1.5"]
BAD_PAGES: list[tuple[dict[str, Any], str]] = [
    ({"limit": "abc"}, "limit"),
    ({"limit": "9" * 30}, "limit"),
    ({"limit": "1e3"}, "limit"),
    ({"order": "\u0000"}, "order"),
    ({"after": "a\u0000b"}, "after"),
]


async def _assert_bad_headers_and_queries_rejected(stack: Stack) -> None:
    _, session_id = await _json_routes(stack)
    async with stack.http() as http:
        env_id = (await http.get("/agents/environments")).json()["data"][0]["id"]
        before = await everything(http, session_id)
        for value in BAD_LAST_EVENT_IDS:
            response = await http.get(f"/agents/sessions/{session_id}/events", headers=[(b"Last-Event-ID", value.encode())])
            error = assert_rejected(response, f"Last-Event-ID {value!r}")
            assert (response.status_code, error["param"]) == (400, "Last-Event-ID"), (value, error)
        lists = [
            "/agents",
            "/agents/environments",
            "/agents/sessions",
            "/files",
            f"/agents/environments/{env_id}/files",
            f"/agents/sessions/{session_id}/turns",
            f"/agents/sessions/{session_id}/items",
            f"/agents/sessions/{session_id}/artifacts",
        ]
        for route in lists:
            for params, param in BAD_PAGES:
                response = await http.get(route, params=params)
                error = assert_rejected(response, f"{route} {params}")
                assert (response.status_code, error["param"]) == (400, param), (route, params, error)
        assert await everything(http, session_id) == before


async def test_out_of_range_headers_and_query_parameters_are_400s(stack: Stack) -> None:
    await _assert_bad_headers_and_queries_rejected(stack)


@pytest.mark.postgres
async def test_out_of_range_headers_and_query_parameters_are_400s_on_postgresql(postgres_stack: Stack) -> None:
    await _assert_bad_headers_and_queries_rejected(postgres_stack)


LONG_PATHS: list[tuple[str, str]] = [
    ("a 300-character name", "/workspace/" + "n" * 300),
    ("5,000 characters", "/workspace/" + "/".join(["p" * 100] * 50)),
    ("2,000 directories deep", "/workspace/" + "d/" * 2000 + "f"),
    ("just over 4,096 bytes", "/workspace/" + "/".join(["q" * 200] * 20) + "/" + "r" * 100),
    ("one component past the depth bound", "/workspace/" + "d/" * (MAX_PATH_DEPTH - 1) + "f"),
]


async def test_paths_too_long_or_too_deep_are_400s_before_they_reach_a_sandbox(stack: Stack) -> None:
    client = stack.aclient()
    env = await create_environment(client)
    async with stack.http() as http:
        before = await everything(http)
        for name, path in LONG_PATHS:
            inline = {"type": "inline", "path": path, "data": ""}
            attempts = [
                (await http.post(f"/agents/environments/{env.id}/files", json=inline), "path"),
                (await http.post("/agents/environments", json={"environment": {**HOSTED, "files": [inline]}}), "environment.files.0.path"),
                (
                    await http.post("/agents/sessions", json={"agent": SCRIPTED, "environment": {**HOSTED, "files": [inline]}}),
                    "environment.files.0.path",
                ),
                (await http.get(f"/agents/environments/{env.id}/files", params={"path": path}), "path"),
            ]
            for response, param in attempts:
                error = assert_rejected(response, name)
                assert (response.status_code, error["code"], error["param"]) == (400, "validation_error", param), (name, error)
        assert await everything(http) == before
        # At the bounds a path is written and listed.
        deepest = "/workspace/" + "d/" * (MAX_PATH_DEPTH - 2) + "f"
        widest = "/workspace/" + "n" * 255
        for path in (deepest, widest):
            written = await http.post(f"/agents/environments/{env.id}/files", json={"type": "inline", "path": path, "data": ""})
            assert written.status_code in (200, 201), written.text
    assert (await client.beta.agents.environments.retrieve(env.id)).status != "failed"


async def test_a_refused_write_near_the_length_bound_is_a_4xx_whose_error_fits_in_grpc_metadata(stack: Stack) -> None:
    # The sandbox's refusal quotes the path: the message and its copy in the
    # status details travel in gRPC metadata, so the services clip it.
    client = stack.aclient()
    env = await create_environment(client)
    blocker = "/workspace/" + "q" * 200
    below_a_file = blocker + "/" + "/".join(["q" * 200] * 18) + "/" + "r" * 200 + "/" + "r" * 65
    async with stack.http() as http:
        first = await http.post(f"/agents/environments/{env.id}/files", json={"type": "inline", "path": blocker, "data": ""})
        assert first.status_code in (200, 201), first.text
        assert len(below_a_file) == 4096
        # gRPC refuses metadata between its soft and hard limits only sometimes.
        for _ in range(5):
            response = await http.post(f"/agents/environments/{env.id}/files", json={"type": "inline", "path": below_a_file, "data": ""})
            error = assert_rejected(response, "write below a file")
            assert error["code"] != "internal_error", error
            assert len(error["message"].encode()) <= 1024, len(error["message"])
