"""``sessions.list(metadata=...)`` through the official SDK: every supplied
pair must match exactly, updates move a session in and out of the filter,
and bad filters are a 400 naming ``metadata``."""

from __future__ import annotations

import openai
from e2e_stack import Stack
from e2e_support import assert_error


def strict(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=stack.base_url, api_key=stack.key, max_retries=0, timeout=30, _strict_response_validation=True
    )


async def test_sessions_list_returns_only_sessions_matching_every_metadata_pair(stack: Stack) -> None:
    client = strict(stack)
    sessions = client.beta.agents.sessions

    async def create(**metadata: str) -> str:
        created = await sessions.create(agent={"model": "scripted"}, environment={"type": "openai_hosted"}, metadata=metadata)
        return created.id

    red_a = await create(team="red", tier="a")
    red_b = await create(team="red", tier="b")
    blue = await create(team="blue", tier="a")

    async def listed(**metadata: str) -> list[str]:
        return [s.id async for s in sessions.list(metadata=metadata, order="asc", limit=1)]

    assert await listed(team="red") == [red_a, red_b]  # limit=1: the filter holds across pages
    assert await listed(team="red", tier="a") == [red_a]
    assert await listed(tier="a") == [red_a, blue]
    assert await listed(team="green") == []
    assert await listed() == [red_a, red_b, blue]

    await sessions.update(red_b, metadata={"team": "blue"})
    assert await listed(team="blue") == [red_b, blue]
    assert await listed(team="red") == [red_a]
    await sessions.delete(blue)
    assert await listed(team="blue") == [red_b]

    other = await stack.new_key("org-metadata-b")
    async with stack.http(other) as http:
        assert (await http.get("/agents/sessions", params={"metadata[team]": "red"})).json()["data"] == []

    async with stack.http() as http:
        assert_error(await http.get("/agents/sessions", params={"metadata": "team"}), 400, "validation_error", param="metadata")
        assert_error(
            await http.get("/agents/sessions", params={"metadata[" + "k" * 65 + "]": "v"}), 400, "validation_error", param="metadata"
        )
        many = {f"metadata[k{i}]": "v" for i in range(17)}
        assert_error(await http.get("/agents/sessions", params=many), 400, "validation_error", param="metadata")
