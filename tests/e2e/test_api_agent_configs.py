"""Agent configurations keep their meaning through the typed contract: every
tool type Berth implements, JSON Schemas with integers, partial updates (absent keeps, null
resets) and session snapshots render exactly as the Agents API wire format
says, and the SDK parses each response under strict validation."""

from __future__ import annotations

from typing import Any

import openai
from e2e_stack import Stack

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 5}}, "required": ["n"]}

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "name": "lookup", "description": "Looks up", "parameters": SCHEMA, "async": False},
    {
        "type": "mcp",
        "server_label": "docs",
        "transport": {"type": "http", "server_url": "https://mcp.example", "headers": {"X-Team": "a"}},
        "allowed_tools": ["search"],
        "request_metadata": {"depth": 2},
    },
    {
        "type": "mcp",
        "server_label": "local",
        "transport": {"type": "stdio", "command": "server", "cwd": "/workspace", "args": ["--quiet"]},
        "connection_origin": "environment",
        "required": True,
    },
]

RENDERED_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "name": "lookup", "description": "Looks up", "parameters": SCHEMA, "defer_loading": False, "async": False},
    {
        "type": "mcp",
        "server_label": "docs",
        "transport": {"type": "http", "server_url": "https://mcp.example", "headers": {"X-Team": "a"}},
        "connection_origin": "service",
        "request_metadata": {"depth": 2},
        "required": False,
        "allowed_tools": ["search"],
        "credential_id": None,
    },
    {
        "type": "mcp",
        "server_label": "local",
        "transport": {"type": "stdio", "command": "server", "cwd": "/workspace", "args": ["--quiet"], "env_vars": []},
        "connection_origin": "environment",
        "request_metadata": {},
        "required": True,
        "allowed_tools": None,
        "credential_id": None,
    },
]


def _without_identity(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in ("id", "created_at", "updated_at")}


async def test_a_saved_agent_renders_every_tool_type_and_updates_by_key(stack: Stack) -> None:
    sdk = openai.AsyncOpenAI(base_url=stack.base_url, api_key=stack.key, max_retries=0, _strict_response_validation=True)
    async with stack.http() as http:
        created = await http.post(
            "/agents",
            json={
                "model": "scripted",
                "name": "Everything",
                "instructions": "Be brief.",
                "metadata": {"team": "a"},
                "tools": TOOLS,
                "reasoning": {"effort": "low"},
                "service_tier": "flex",
                "text": {"format": {"type": "json_schema", "schema": SCHEMA}, "verbosity": "high"},
                "experimental": {"time_awareness": True},
            },
        )
        assert created.status_code == 200, created.text
        body = created.json()
        assert _without_identity(body) == {
            "object": "agent",
            "name": "Everything",
            "metadata": {"team": "a"},
            "model": "scripted",
            "instructions": "Be brief.",
            "multi_agent": {"enabled": False, "max_concurrent_subagents": None},
            "reasoning": {"effort": "low", "summary": None},
            "service_tier": "flex",
            "text": {"format": {"type": "json_schema", "schema": SCHEMA}, "verbosity": "high"},
            "tools": RENDERED_TOOLS,
            "experimental": {"time_awareness": True},
        }
        assert isinstance(body["tools"][0]["parameters"]["properties"]["n"]["maximum"], int)
        retrieved = await sdk.beta.agents.retrieve(body["id"])
        assert retrieved.model_dump(mode="json", by_alias=True, exclude_unset=True) == body

        updated = await http.post(
            f"/agents/{body['id']}",
            json={"name": None, "instructions": None, "text": None, "experimental": None, "tools": TOOLS[:1]},
        )
        assert updated.status_code == 200, updated.text
        after = updated.json()
        assert after["name"] is None and after["instructions"] is None and after["metadata"] == {"team": "a"}
        assert after["text"] == {"format": {"type": "text"}, "verbosity": "medium"}
        # A null experimental block keeps what there is; null elsewhere resets.
        assert after["experimental"] == {"time_awareness": True} and after["reasoning"] == {"effort": "low", "summary": None}
        assert after["tools"] == RENDERED_TOOLS[:1] and after.get("compaction") is None
        await sdk.beta.agents.retrieve(body["id"])
    await sdk.close()


async def test_a_session_snapshot_hides_credentials_and_takes_partial_updates(stack: Stack) -> None:
    sdk = openai.AsyncOpenAI(base_url=stack.base_url, api_key=stack.key, max_retries=0, _strict_response_validation=True)
    async with stack.http() as http:
        saved = (await http.post("/agents", json={"model": "scripted", "name": "base", "instructions": "Saved.", "tools": TOOLS[:1]})).json()
        secret_tools = [
            *TOOLS[:1],
            {
                "type": "mcp",
                "server_label": "docs",
                "transport": {"type": "http", "server_url": "https://mcp.example", "headers": {"X-Team": "a"}, "authorization": "Bearer s3cret"},
            },
        ]
        created = await http.post(
            "/agents/sessions",
            json={
                "agent_id": saved["id"],
                "agent": {"instructions": None, "tools": secret_tools, "experimental": {}},
                "environment": {"type": "none"},
                "input": "hello",
                "metadata": {"k": "v"},
            },
        )
        assert created.status_code == 200, created.text
        session = created.json()
        assert "s3cret" not in created.text
        assert session["agent"] == {
            "id": saved["id"],
            "name": "base",
            "model": "scripted",
            "instructions": None,
            "multi_agent": {"enabled": False, "max_concurrent_subagents": None},
            "reasoning": {"effort": None, "summary": None},
            "service_tier": "auto",
            "text": {"format": {"type": "text"}, "verbosity": "medium"},
            "tools": [
                RENDERED_TOOLS[0],
                {**RENDERED_TOOLS[1], "transport": {"type": "http", "server_url": "https://mcp.example"}, "allowed_tools": None, "request_metadata": {}},
            ],
            "experimental": {"time_awareness": False},
        }
        assert session["metadata"] == {"k": "v"} and session["environment"] == {"type": "none"}
        retrieved = await sdk.beta.agents.sessions.retrieve(session["id"])
        assert retrieved.model_dump(mode="json", by_alias=True, exclude_unset=True)["agent"] == session["agent"]

        updated = await http.post(
            f"/agents/sessions/{session['id']}",
            json={"agent": {"model": "scripted-2", "reasoning": {"effort": "high"}, "tools": None}},
        )
        assert updated.status_code == 200, updated.text
        agent = updated.json()["agent"]
        assert agent["model"] == "scripted-2" and agent["reasoning"] == {"effort": "high", "summary": None}
        assert agent["tools"] == [] and agent["experimental"] == {"time_awareness": False}
        assert updated.json()["metadata"] == {"k": "v"}
        await sdk.beta.agents.sessions.retrieve(session["id"])
    await sdk.close()


async def test_an_empty_agent_name_stays_distinct_from_no_name(stack: Stack) -> None:
    async with stack.http() as http:
        empty = await http.post("/agents", json={"model": "scripted", "name": ""})
        unnamed = await http.post("/agents", json={"model": "scripted"})
        assert (empty.status_code, unnamed.status_code) == (200, 200)
        assert empty.json()["name"] == "" and unnamed.json()["name"] is None
        retrieved = await http.get(f"/agents/{empty.json()['id']}")
        assert retrieved.json()["name"] == ""
