"""Schemathesis against the OpenAPI document the gateway serves, on the real
in-process stack: every operation with generated requests, then stateful
scenarios that follow the document's links (create an agent, then retrieve,
update or delete it by the returned ID; a session, then its events, turns,
items and artifacts). No response may be a server error, and every response
must match the document: status, content type and body schema (so the SDK's
types, which the response schemas are).

The run is bounded by example counts, not by time. The model endpoint is a
fake on 127.0.0.1 that refuses every call, so generated turns fail fast
without leaving the machine."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import hypothesis
import pytest
import schemathesis
from e2e_stack import Stack, destroy_sandboxes, start_stack
from schemathesis import Case, Response
from schemathesis.checks import (
    CheckFunction,
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from turns_support import FakeChatModel

from gateway.openapi import OPENAPI_PATH, OPERATIONS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

T = TypeVar("T")

CHECKS: list[CheckFunction] = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]

# Per operation, and per stateful run: enough to reach every status an
# operation documents, small enough for a shared CI machine.
_EXAMPLES_PER_OPERATION = 12
_STATEFUL_SCENARIOS = 15
_SETTINGS = hypothesis.settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(hypothesis.HealthCheck),
    print_blob=False,
)

# Schemathesis' own generation: no coverage phase (hundreds of boundary
# cases per operation); an open event stream is read for at most 1 s.
_CONFIG = """
request-timeout = 10
max-stream-events = 5
[phases.coverage]
enabled = false
[phases.examples]
enabled = false
"""


class _LoopThread:
    """An event loop in a thread of its own, so the stack keeps serving
    while schemathesis (synchronous) sends requests from the test."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="stack-loop", daemon=True)
        self._thread.start()

    def run(self, awaitable: Awaitable[T], timeout: float = 120) -> T:
        async def wrapped() -> T:
            return await awaitable

        return asyncio.run_coroutine_threadsafe(wrapped(), self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


@pytest.fixture(scope="module")
def live_stack(tmp_path_factory: pytest.TempPathFactory, bwrap_available: None) -> Iterator[Stack]:
    data_dir = tmp_path_factory.mktemp("schemathesis") / "berth"
    with FakeChatModel([], usage=[]) as model:
        loop = _LoopThread()
        try:
            stack, stop = loop.run(start_stack(data_dir, model_base_url=model.base_url, model_api_key="sk-fake"))
            try:
                yield stack
            finally:
                loop.run(stop())
                loop.run(destroy_sandboxes(data_dir))
        finally:
            loop.close()


_KEY: list[str] = []


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {_KEY[0]}"}


def _origin(stack: Stack) -> str:
    return stack.base_url.removesuffix("/v1")


@pytest.fixture(scope="module")
def api_schema(live_stack: Stack) -> Any:
    config = schemathesis.Config.from_str(_CONFIG)
    _KEY[:] = [live_stack.key]
    return schemathesis.openapi.from_url(_origin(live_stack) + OPENAPI_PATH, config=config)


# One test per route of the gateway (the document covers exactly these).
_OPERATIONS = sorted(OPERATIONS)


@pytest.mark.parametrize(("method", "path"), _OPERATIONS, ids=[f"{m} {p}" for m, p in _OPERATIONS])
def test_every_operation_answers_generated_requests_as_documented(api_schema: Any, method: str, path: str) -> None:
    operation = api_schema[path][method]

    @hypothesis.given(case=operation.as_strategy())
    @hypothesis.settings(_SETTINGS, max_examples=_EXAMPLES_PER_OPERATION)
    def run(case: Case[Any]) -> None:
        case.call_and_validate(headers=_auth(), checks=CHECKS)

    run()


def test_stateful_scenarios_along_the_links_answer_as_documented(api_schema: Any) -> None:
    answered: Counter[tuple[str, int]] = Counter()

    class Workflow(api_schema.as_state_machine()):  # type: ignore[misc]
        def get_call_kwargs(self, case: Case[Any]) -> dict[str, Any]:
            return {"headers": _auth()}

        def after_call(self, response: Response, case: Case[Any]) -> None:
            answered[(f"{case.method} {case.path}", response.status_code)] += 1

        def validate_response(
            self, response: Response, case: Case[Any], additional_checks: Any = None, **kwargs: Any
        ) -> None:
            case.validate_response(response, checks=CHECKS, transport_kwargs=kwargs or None)

    Workflow.run(settings=hypothesis.settings(_SETTINGS, max_examples=_STATEFUL_SCENARIOS, stateful_step_count=6))
    # The links were followed: an operation on a created resource succeeded.
    followed = {op for (op, status), _ in answered.items() if "{" in op and 200 <= status < 300}
    assert followed, sorted(answered.items())


def test_the_document_links_creates_to_the_operations_on_what_they_create(live_stack: Stack) -> None:
    import httpx

    document = httpx.get(_origin(live_stack) + OPENAPI_PATH, timeout=10).json()
    links = document["paths"]["/v1/agents"]["post"]["responses"]["200"]["links"]
    assert set(links) == {"retrieve_agent", "update_agent", "delete_agent"}
    session_links = document["paths"]["/v1/agents/sessions"]["post"]["responses"]["200"]["links"]
    assert {"create_events", "stream_events", "list_turns", "list_items"} <= set(session_links)
    assert session_links["list_turns"]["parameters"] == {"path.session_id": "$response.body#/id"}
