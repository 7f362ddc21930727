"""Every response of every public route parses with the official SDK's own
models under strict validation (no type coercion), and carries no field the
SDK does not know beyond Berth's documented additions. A route added
without a case here fails the coverage check."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pydantic
from e2e_stack import Stack
from openai.types.beta.agent_session_event import AgentSessionEvent
from turns_support import idle_after_turn, open_events
from waiting import wait_until

from gateway.openapi import OPENAPI_PATH, OPERATIONS
from gateway.routes import (
    agents,
    automations,
    environment_templates,
    environments,
    files,
    session_resources,
    sessions,
    subagents,
    vaults,
    webhooks,
)

# Route -> the SDK model of its JSON body; None: no JSON body (202, bytes,
# SSE). The OpenAPI document's table is the one home of that claim; this
# test holds it against real responses.
MODELS: dict[tuple[str, str], Any] = {
    key: op.response if op.body in ("json", "json_or_sse") else None
    for key, op in OPERATIONS.items()
    if key[1].startswith("/v1/") and key[1] != OPENAPI_PATH
}

# Fields Berth adds to SDK objects (docs/wire-contract.md), by SDK model.
_ENVIRONMENT_ADDITIONS = frozenset(
    {"capability_directories", "network", "packages", "container_size", "lifetime", "session_count", "error", "created_at"}
)
ADDITIONS: dict[str, frozenset[str]] = {
    "EnvironmentInfo": _ENVIRONMENT_ADDITIONS | {"vault_ids"},
    "EnvironmentResourceOpenAIHosted": _ENVIRONMENT_ADDITIONS | {"status"},
    "EnvironmentFile": frozenset({"id", "type", "file_id"}),
    "EnvironmentResourceOpenAIHostedNetwork": frozenset({"blocked_domains"}),
    "WebhookEndpoint": frozenset({"status", "disabled_reason", "consecutive_failures"}),
    "WebhookEndpointWithSecret": frozenset({"status", "disabled_reason", "consecutive_failures"}),
    # EnvironmentTemplate.network
    "Network": frozenset({"blocked_domains"}),
}

# The OpenAI list envelope, which the SDK's page classes do not declare.
_PAGE_ENVELOPE = frozenset({"object", "first_id", "last_id"})

EVENT_ADAPTER: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(AgentSessionEvent)


def _public_routes() -> set[tuple[str, str]]:
    routes: set[tuple[str, str]] = set()
    for module in (
        agents,
        automations,
        environment_templates,
        environments,
        files,
        sessions,
        session_resources,
        subagents,
        vaults,
        webhooks,
    ):
        for route in module.router.routes:
            for method in getattr(route, "methods", ()):
                routes.add((method, str(getattr(route, "path"))))
    return routes


def _unknown_fields(value: Any, out: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """(model, key) of every key the SDK's models did not declare."""
    if isinstance(value, pydantic.BaseModel):
        name = type(value).__name__
        allowed = _PAGE_ENVELOPE if name.startswith("Sync") and "Page[" in name else ADDITIONS.get(name, frozenset())
        for key in value.model_extra or {}:
            if key not in allowed:
                out.add((name, key))
        for key in type(value).model_fields:
            _unknown_fields(getattr(value, key), out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _unknown_fields(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _unknown_fields(v, out)
    return out


def _parse_strictly(model: Any, body: Any, where: str) -> Any:
    parsed = pydantic.TypeAdapter(model).validate_python(body, strict=True)
    unknown = _unknown_fields(parsed, set())
    assert not unknown, f"{where}: fields the SDK does not know: {sorted(unknown)}"
    return parsed


class Api:
    """Calls routes by template and checks each response against MODELS."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http
        self.covered: set[tuple[str, str]] = set()

    async def call(self, method: str, template: str, *, status: int | None = None, **kwargs: Any) -> Any:
        params = {k: kwargs.pop(k) for k in list(kwargs) if "{" + k + "}" in template}
        response = await self.http.request(method, template.removeprefix("/v1").format(**params), **kwargs)
        ok = response.status_code == status if status is not None else response.is_success
        assert ok, (method, template, response.status_code, response.text)
        self.covered.add((method, template))
        model = MODELS[(method, template)]
        if model is None:
            return response
        body = response.json()
        _parse_strictly(model, body, f"{method} {template}")
        return body


async def _subagent_routes(api: Api, http: httpx.AsyncClient) -> None:
    """A turn that makes each of the six subagent calls, then every
    ``sessions.subagents`` route."""
    script = "subagent a: hi\nsubagent wait\nsubagent close a\nsubagent resume a\nsubagent interrupt a\nsubagent send a: again\nsubagent wait\nok"
    session = await api.call(
        "POST",
        "/v1/agents/sessions",
        json={"agent": {"model": "scripted", "multi_agent": {"enabled": True}}, "environment": {"type": "none"}, "input": script},
    )
    async with open_events(http, session["id"], last_event_id="0") as reader:
        async with asyncio.timeout(60):
            started = await reader.until(lambda e: e.type == "agent.session.turn.created")
            turn_id = str(started[-1].data["turn"]["id"])
            frames = await reader.until(idle_after_turn(turn_id))
    for frame in frames:
        parsed = EVENT_ADAPTER.validate_python(frame.data, strict=True)
        assert not _unknown_fields(parsed, set()), frame.type
    kinds = {f.type for f in frames}
    assert {"agent.session.subagent.created", "agent.session.subagent.closed", "agent.session.subagent.active"} <= kinds
    items = await api.call("GET", "/v1/agents/sessions/{session_id}/items", session_id=session["id"])
    assert {i["type"] for i in items["data"]} >= {
        "create_subagent_call",
        "send_subagent_input_call",
        "wait_for_subagents_call",
        "interrupt_subagent_call",
        "resume_subagent_call",
        "close_subagent_call",
    }
    ids = {"session_id": session["id"]}
    (sub,) = (await api.call("GET", "/v1/agents/sessions/{session_id}/subagents", **ids))["data"]
    ids["subagent_id"] = sub["id"]
    await api.call("GET", "/v1/agents/sessions/{session_id}/subagents/{subagent_id}", **ids)
    await api.call("GET", "/v1/agents/sessions/{session_id}/subagents/{subagent_id}/items", **ids)
    turns = await api.call("GET", "/v1/agents/sessions/{session_id}/subagents/{subagent_id}/turns", **ids)
    assert {t["subagent_id"] for t in turns["data"]} == {sub["id"]}
    ids["turn_id"] = turns["data"][0]["id"]
    await api.call("GET", "/v1/agents/sessions/{session_id}/subagents/{subagent_id}/turns/{turn_id}", **ids)
    await api.call("GET", "/v1/agents/sessions/{session_id}/subagents/{subagent_id}/turns/{turn_id}/items", **ids)


async def test_every_route_returns_what_the_sdk_models_parse_strictly(stack: Stack) -> None:
    async with stack.http() as http:
        api = Api(http)

        agent = await api.call("POST", "/v1/agents", json={"model": "scripted", "name": "shapes"})
        await api.call("GET", "/v1/agents")
        await api.call("GET", "/v1/agents/{agent_id}", agent_id=agent["id"])
        await api.call("POST", "/v1/agents/{agent_id}", agent_id=agent["id"], json={"instructions": "Be brief."})

        vault = await api.call("POST", "/v1/vaults", json={"name": "shapes", "metadata": {"k": "v"}})
        vault_ids = {"vault_id": vault["id"]}
        await api.call("GET", "/v1/vaults")
        await api.call("GET", "/v1/vaults/{vault_id}", **vault_ids)
        await api.call("POST", "/v1/vaults/{vault_id}", json={"name": None}, **vault_ids)
        bearer = {"type": "static_bearer", "token": "t", "mcp_server_url": "https://mcp.example.test/"}
        credential = await api.call(
            "POST", "/v1/vaults/{vault_id}/credentials", json={"name": "c", "auth": bearer}, **vault_ids
        )
        credential_ids = {**vault_ids, "credential_id": credential["id"]}
        await api.call("GET", "/v1/vaults/{vault_id}/credentials", **vault_ids)
        await api.call("GET", "/v1/vaults/{vault_id}/credentials/{credential_id}", **credential_ids)
        await api.call(
            "POST", "/v1/vaults/{vault_id}/credentials/{credential_id}", json={"metadata": {"k": "w"}}, **credential_ids
        )
        await api.call("DELETE", "/v1/vaults/{vault_id}/credentials/{credential_id}", **credential_ids)
        await api.call("DELETE", "/v1/vaults/{vault_id}", **vault_ids)

        uploaded = await api.call(
            "POST", "/v1/files", files={"file": ("notes.txt", b"notes\n")}, data={"purpose": "user_data"}
        )
        await api.call("GET", "/v1/files")
        await api.call("GET", "/v1/files/{file_id}", file_id=uploaded["id"])
        await api.call("GET", "/v1/files/{file_id}/content", file_id=uploaded["id"])

        env = await api.call("POST", "/v1/agents/environments", json={"environment": {"type": "openai_hosted"}})
        await api.call("GET", "/v1/agents/environments")
        await api.call("GET", "/v1/agents/environments/{environment_id}", environment_id=env["id"])
        await api.call(
            "POST",
            "/v1/agents/environments/{environment_id}/files",
            environment_id=env["id"],
            json={"type": "file_id", "file_id": uploaded["id"], "path": "/workspace/notes.txt"},
        )
        await api.call("GET", "/v1/agents/environments/{environment_id}/files", environment_id=env["id"])

        template = await api.call(
            "POST",
            "/v1/agents/environments/templates",
            json={"name": "shapes", "files": [{"type": "file_id", "file_id": uploaded["id"], "path": "/workspace/notes.txt"}]},
        )
        template_id = {"environment_template_id": template["id"]}
        await api.call("GET", "/v1/agents/environments/templates")
        await api.call("GET", "/v1/agents/environments/templates/{environment_template_id}", **template_id)
        await api.call(
            "POST", "/v1/agents/environments/templates/{environment_template_id}", **template_id, json={"name": None}
        )
        await api.call("DELETE", "/v1/agents/environments/templates/{environment_template_id}", **template_id)

        session = await api.call(
            "POST",
            "/v1/agents/sessions",
            json={
                "agent_id": agent["id"],
                "environment": {"type": "reference", "environment_id": env["id"]},
                "spend_control": {"limit": 100},
                "review": "none",
            },
        )
        session_id = session["id"]
        await api.call("GET", "/v1/agents/sessions")
        await api.call("GET", "/v1/agents/sessions/{session_id}", session_id=session_id)
        await api.call("POST", "/v1/agents/sessions/{session_id}", session_id=session_id, json={"metadata": {"k": "v"}})

        # One turn that runs a command, publishes an artifact and calls an
        # application function, so every item and event type Berth emits
        # for such a turn is on the stream.
        script = "$ echo shapes | tee $REBYTE_OUTPUT_DIR/out.txt\ncall lookup {}\ndone"
        await api.call(
            "POST",
            "/v1/agents/sessions/{session_id}",
            session_id=session_id,
            json={"agent": {"tools": [{"type": "function", "name": "lookup", "description": "", "parameters": {"type": "object"}}]}},
        )
        message = {"role": "user", "content": [{"type": "input_text", "text": script}]}
        await api.call(
            "POST",
            "/v1/agents/sessions/{session_id}/events",
            session_id=session_id,
            status=202,
            json={"events": [{"type": "agent.session.input.message", "input": [message]}]},
        )
        async with open_events(http, session_id, last_event_id="0") as reader:
            async with asyncio.timeout(60):
                waiting = await reader.until(lambda e: e.type == "agent.session.requires_action")
                turn_id = str(waiting[-1].data["session"]["required_actions"][0]["turn_id"])
                call_id = str(waiting[-1].data["session"]["required_actions"][0]["call_id"])
                await api.call(
                    "POST",
                    "/v1/agents/sessions/{session_id}/events",
                    session_id=session_id,
                    status=202,
                    json={
                        "events": [
                            {
                                "type": "agent.session.input.tool_result",
                                "turn_id": turn_id,
                                "call_id": call_id,
                                "success": True,
                                "output": "42",
                            }
                        ]
                    },
                )
                frames = waiting + await reader.until(idle_after_turn(turn_id))
        api.covered.add(("GET", "/v1/agents/sessions/{session_id}/events"))
        for frame in frames:
            parsed = EVENT_ADAPTER.validate_python(frame.data, strict=True)
            unknown = _unknown_fields(parsed, set())
            assert not unknown, f"{frame.type}: fields the SDK does not know: {sorted(unknown)}"
        kinds = {f.type for f in frames}
        assert {"agent.session.turn.item.added", "agent.output.command_execution_output.delta"} <= kinds, kinds

        turns = await api.call("GET", "/v1/agents/sessions/{session_id}/turns", session_id=session_id)
        assert turns["data"][0]["status"] == "completed"
        await api.call("GET", "/v1/agents/sessions/{session_id}/turns/{turn_id}", session_id=session_id, turn_id=turn_id)
        items = await api.call("GET", "/v1/agents/sessions/{session_id}/items", session_id=session_id)
        assert {i["type"] for i in items["data"]} == {"message", "command_execution", "function_call", "function_call_output"}
        await api.call(
            "GET", "/v1/agents/sessions/{session_id}/turns/{turn_id}/items", session_id=session_id, turn_id=turn_id
        )
        artifacts = await api.call("GET", "/v1/agents/sessions/{session_id}/artifacts", session_id=session_id)

        async def traced() -> Any:
            traces = await api.call("GET", "/v1/agents/sessions/{session_id}/traces", session_id=session_id)
            return traces["data"]

        # Published right after the turn's end.
        assert [t["id"] for t in await wait_until(traced, 30, what="the turn's trace")] == [turn_id]
        (artifact,) = artifacts["data"]
        ids = {"session_id": session_id, "artifact_id": artifact["id"]}
        await api.call("GET", "/v1/agents/sessions/{session_id}/artifacts/{artifact_id}", **ids)
        content = await api.call("GET", "/v1/agents/sessions/{session_id}/artifacts/{artifact_id}/content", **ids)
        assert content.content == b"shapes\n"
        await api.call("DELETE", "/v1/agents/sessions/{session_id}/artifacts/{artifact_id}", **ids)

        await _subagent_routes(api, http)
        target = {"type": "existing_session", "session_id": session_id, "instructions": "again"}
        auto = await api.call(
            "POST",
            "/v1/agents/automations",
            json={"type": "periodic", "name": "shapes", "expression": "0 9 * * *", "timezone": "UTC", "target": target},
        )
        ids = {"automation_id": auto["id"]}
        await api.call("GET", "/v1/agents/automations")
        await api.call("GET", "/v1/agents/automations/{automation_id}", **ids)
        await api.call("POST", "/v1/agents/automations/{automation_id}", **ids, json={"name": "shapes 2"})
        await api.call("POST", "/v1/agents/automations/{automation_id}/pause", **ids)
        await api.call("POST", "/v1/agents/automations/{automation_id}/resume", **ids)
        run = await api.call("POST", "/v1/agents/automations/{automation_id}/invocations", **ids)
        await api.call("GET", "/v1/agents/automations/{automation_id}/invocations", **ids)

        async def delivered() -> bool:
            response = await http.get(f"/agents/automations/{auto['id']}/invocations/{run['id']}")
            return bool(response.json()["status"] != "queued")

        await wait_until(delivered, 20.0, what="the manual run delivered")
        await api.call(
            "GET", "/v1/agents/automations/{automation_id}/invocations/{invocation_id}", **ids, invocation_id=run["id"]
        )
        await api.call("DELETE", "/v1/agents/automations/{automation_id}", **ids)

        async def settled() -> bool:
            # The turn the manual run queued ended, so the session may be deleted.
            response = await http.get(f"/agents/sessions/{session_id}/turns")
            return all(t["status"] not in ("queued", "in_progress", "waiting") for t in response.json()["data"])

        await wait_until(settled, 20.0, what="the automation's turn ended")

        await api.call("DELETE", "/v1/agents/sessions/{session_id}", session_id=session_id)
        await api.call("DELETE", "/v1/agents/environments/{environment_id}", environment_id=env["id"])
        await api.call("DELETE", "/v1/files/{file_id}", file_id=uploaded["id"])
        await api.call("DELETE", "/v1/agents/{agent_id}", agent_id=agent["id"])

        # An event type this test never causes: nothing is delivered anywhere.
        hook = {"name": "shapes", "url": "https://example.com/hook", "event_types": ["agent.automation.invocation.failed"]}
        endpoint = await api.call("POST", "/v1/webhook_endpoints", json=hook)
        ids = {"webhook_endpoint_id": endpoint["id"]}
        await api.call("GET", "/v1/webhook_endpoints")
        await api.call("GET", "/v1/webhook_endpoints/{webhook_endpoint_id}", **ids)
        await api.call("POST", "/v1/webhook_endpoints/{webhook_endpoint_id}", **ids, json={"name": "renamed"})
        await api.call("POST", "/v1/webhook_endpoints/{webhook_endpoint_id}/rotate_secret", **ids, json={})
        await api.call("GET", "/v1/webhook_endpoints/{webhook_endpoint_id}/deliveries", **ids)
        await api.call("GET", "/v1/webhook_event_types")
        await api.call("DELETE", "/v1/webhook_endpoints/{webhook_endpoint_id}", **ids)

    assert _public_routes() - api.covered == set()
    assert set(MODELS) == _public_routes()
