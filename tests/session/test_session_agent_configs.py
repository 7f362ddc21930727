"""Agent configuration resolution, without any service."""

from __future__ import annotations

import pytest
from openai.types.beta import agent_session
from pydantic import TypeAdapter

from services.core.errors import InvalidArgument
from services.session.agents import (
    apply_session_agent_update,
    normalize_agent_create,
    render_session_agent,
    resolve_session_agent,
)

SNAPSHOT = TypeAdapter(agent_session.Agent)


def test_session_overrides_replace_saved_fields_and_merge_experimental_settings() -> None:
    _, _, saved = normalize_agent_create(
        {"model": "m", "instructions": "saved", "experimental": {"time_awareness": True}, "tools": [{"type": "tool_search"}]}
    )
    config = resolve_session_agent(saved, {"model": "n", "tools": None, "reasoning": {"effort": "low"}})
    assert config["model"] == "n" and config["instructions"] == "saved" and config["tools"] == []
    assert config["experimental"] == {"time_awareness": True} and config["reasoning"] == {"effort": "low", "summary": None}
    SNAPSHOT.validate_python(render_session_agent("agent_1", "name", config))


def test_tool_search_is_kept_in_saved_agents_but_not_shown_in_session_snapshots() -> None:
    config = resolve_session_agent(None, {"model": "m", "tools": [{"type": "tool_search"}, {"type": "web_search"}]})
    rendered = render_session_agent("agent_1", None, config)
    assert [t["type"] for t in rendered["tools"]] == ["web_search"]
    SNAPSHOT.validate_python(rendered)


def test_session_agent_updates_touch_only_the_documented_fields() -> None:
    config = resolve_session_agent(None, {"model": "m", "reasoning": {"effort": "low", "summary": "auto"}})
    updated = apply_session_agent_update(config, {"reasoning": {"effort": None}, "service_tier": "flex"})
    assert updated["reasoning"] == {"effort": None, "summary": "auto"} and updated["service_tier"] == "flex"
    with pytest.raises(InvalidArgument) as error:
        apply_session_agent_update(config, {"instructions": "x"})
    assert error.value.param == "agent.instructions"


def test_an_inline_agent_needs_a_model() -> None:
    with pytest.raises(InvalidArgument) as error:
        resolve_session_agent(None, {"instructions": "x"})
    assert error.value.param == "agent.model"
