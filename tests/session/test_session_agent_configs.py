"""Agent configuration resolution, without any service: bodies validated and
converted as the gateway does it, resolved as the Session service does it,
rendered as the gateway does it."""

from __future__ import annotations

from typing import Any

import pytest
from openai.types.beta import agent_session
from pydantic import TypeAdapter

from berth.session.v1 import session_pb2
from gateway import convert, render
from gateway.errors import ApiError
from gateway.validation import AgentCreateBody, SessionCreateBody, SessionUpdateBody, validate_body
from services.session.agents import AgentConfig, apply_config, config_message, new_config

SNAPSHOT = TypeAdapter(agent_session.Agent)
NONE_ENV = {"type": "none"}


def _saved(body: dict[str, Any]) -> AgentConfig:
    return new_config(convert.create_agent_request(validate_body(AgentCreateBody, body)).config, persisted=True)


def _session_agent(saved: AgentConfig | None, agent: dict[str, Any]) -> AgentConfig:
    body: dict[str, Any] = {"agent": agent, "environment": NONE_ENV}
    if saved is not None:
        body["agent_id"] = "agent_saved"
    request = convert.create_session_request(validate_body(SessionCreateBody, body))
    if saved is None:
        return new_config(request.agent, prefix="agent", persisted=False)
    return apply_config(saved, request.agent, set(request.agent_mask.paths), prefix="agent", persisted=False)


def _rendered(config: AgentConfig) -> dict[str, Any]:
    return render.session_agent(session_pb2.SessionAgent(id="agent_1", name="name", config=config_message(config)))


def test_session_overrides_replace_saved_fields_and_merge_experimental_settings() -> None:
    saved = _saved(
        {
            "model": "m",
            "instructions": "saved",
            "experimental": {"time_awareness": True},
            "tools": [{"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}}],
        }
    )
    config = _session_agent(saved, {"model": "n", "tools": None, "reasoning": {"effort": "low"}})
    assert config["model"] == "n" and config["instructions"] == "saved" and config["tools"] == []
    assert config["experimental"] == {"time_awareness": True} and config["reasoning"] == {"effort": "low", "summary": None}
    SNAPSHOT.validate_python(_rendered(config))


def test_tool_search_is_kept_in_saved_agents_but_not_shown_in_session_snapshots() -> None:
    config = _session_agent(None, {"model": "m", "tools": [{"type": "tool_search"}, {"type": "web_search"}]})
    rendered = _rendered(config)
    assert [t["type"] for t in rendered["tools"]] == ["web_search"]
    SNAPSHOT.validate_python(rendered)


def test_session_agent_updates_touch_only_the_documented_fields() -> None:
    config = _session_agent(None, {"model": "m", "reasoning": {"effort": "low", "summary": "auto"}})
    request = convert.update_session_request(
        "sess_1", validate_body(SessionUpdateBody, {"agent": {"reasoning": {"effort": None}, "service_tier": "flex"}})
    )
    paths = {p.removeprefix("agent.") for p in request.update_mask.paths}
    updated = apply_config(config, request.agent, paths, prefix="agent", persisted=False)
    assert updated["reasoning"] == {"effort": None, "summary": "auto"} and updated["service_tier"] == "flex"
    with pytest.raises(ApiError) as error:
        validate_body(SessionUpdateBody, {"agent": {"instructions": "x"}})
    assert error.value.param == "agent.instructions"


def test_user_json_schemas_keep_their_integers() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 5}}}
    saved = _saved({"model": "m", "tools": [{"type": "function", "name": "f", "description": "", "parameters": schema}]})
    assert saved["tools"][0]["parameters"] == schema
    shown = render.agent(session_pb2.Agent(id="agent_1", config=config_message(saved)))
    assert shown["tools"][0]["parameters"]["properties"]["n"]["maximum"] == 5
    assert isinstance(shown["tools"][0]["parameters"]["properties"]["n"]["maximum"], int)
