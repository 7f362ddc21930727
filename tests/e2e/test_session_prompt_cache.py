"""``prompt_cache_options`` applied: a session with a TTL sends the OpenAI
API's prompt cache retention and its own ID as the cache key on every model
call (Chat Completions and Responses), one without sends neither, and an
update changes what the next turn sends. Driven through the official SDK
against the streaming fake model server."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from e2e_stack import Stack, start_stack
from e2e_support import run_script
from fake_model import Answer, FakeModel
from turns_support import strict_client


@pytest.fixture
def model() -> Iterator[FakeModel]:
    with FakeModel(default=Answer(text="cached answer", usage=(40, 3))) as fake:
        yield fake


@pytest.fixture(params=["chat", "responses"])
async def model_stack(
    request: pytest.FixtureRequest, tmp_path: Path, bwrap_available: None, model: FakeModel
) -> AsyncIterator[Stack]:
    stack, stop = await start_stack(
        tmp_path / "berth", model_base_url=model.base_url, model_api_key="x", model_api=request.param
    )
    try:
        yield stack
    finally:
        await stop()


async def test_prompt_cache_ttl_reaches_every_model_call_of_the_session(model_stack: Stack, model: FakeModel) -> None:
    client = strict_client(model_stack)
    sessions = client.beta.agents.sessions
    cached = await sessions.create(
        agent={"model": "some-model"}, environment={"type": "openai_hosted"}, prompt_cache_options={"ttl": "12h"}
    )
    assert cached.prompt_cache_options is not None and cached.prompt_cache_options.ttl == "12h"
    plain = await sessions.create(agent={"model": "some-model"}, environment={"type": "openai_hosted"})
    assert plain.prompt_cache_options is None

    assert (await run_script(client, cached.id, "hello")).status == "completed"
    assert (await run_script(client, plain.id, "hello")).status == "completed"
    first, second = model.bodies
    assert (first["prompt_cache_retention"], first["prompt_cache_key"]) == ("24h", cached.id)
    assert "prompt_cache_retention" not in second and "prompt_cache_key" not in second

    updated = await sessions.update(cached.id, prompt_cache_options=None)
    assert updated.prompt_cache_options is None
    assert (await run_script(client, cached.id, "again")).status == "completed"
    assert "prompt_cache_retention" not in model.bodies[-1]
