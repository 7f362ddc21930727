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
import re
import threading
from collections import Counter
from collections.abc import Awaitable, Iterator
from typing import Any, TypeVar

import httpx
import hypothesis
import pytest
import schemathesis
from e2e_stack import Stack, destroy_sandboxes, start_stack
from schemathesis import Case, GenerationMode, Response
from schemathesis.checks import (
    CheckFunction,
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.failures import FailureGroup
from fake_model import Answer, FakeModel

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
_STATEFUL_SCENARIOS = 30
# No shrinking: a live server is external state, and replaying a scenario
# against it does not draw the same data (hypothesis calls that flaky).
_SETTINGS = hypothesis.settings(
    phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(hypothesis.HealthCheck),
    print_blob=False,
)

# Schemathesis' own configuration (the stateful run reads it): valid
# requests only, so scenarios get past their first step; no coverage phase
# (hundreds of boundary cases per operation). An open event stream is read
# for at most 5 events or 3 s.
_CONFIG = """
request-timeout = 3
max-stream-events = 5
[generation]
mode = "positive"
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
    with FakeModel(default=Answer(text="ok")) as model:
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


def _auth(stack: Stack) -> dict[str, str]:
    return {"Authorization": f"Bearer {stack.key}"}


def _origin(stack: Stack) -> str:
    return stack.base_url.removesuffix("/v1")


@pytest.fixture(scope="module")
def api_schema(live_stack: Stack) -> Any:
    config = schemathesis.Config.from_str(_CONFIG)
    return schemathesis.openapi.from_url(_origin(live_stack) + OPENAPI_PATH, config=config)


# Kept from a generated session body; the rest is replaced by a body that
# passes the rules between fields the document cannot state (agent.model
# without agent_id, input for environment "none"), so scenarios create
# sessions and go on to their events, turns and items.
_SESSION_KEYS_KEPT = ("metadata", "prompt_cache_options", "review")
_SESSION_BODY = {"agent": {"model": "fake-model"}, "environment": {"type": "none"}, "input": "hello"}


@pytest.fixture(scope="module")
def resources(live_stack: Stack) -> dict[str, str]:
    """One real object of each kind, by the path parameter that names it, so
    generated requests reach the operations on existing objects too."""
    headers = {**_auth(live_stack), "OpenAI-Beta": "agents=v1"}
    with httpx.Client(base_url=_origin(live_stack), headers=headers, timeout=30) as client:
        agent = client.post("/v1/agents", json={"model": "fake-model"})
        environment = client.post("/v1/agents/environments", json={"environment": {"type": "openai_hosted"}})
        stored = client.post("/v1/files", files={"file": ("notes.txt", b"notes")}, data={"purpose": "user_data"})
        session = client.post("/v1/agents/sessions", json=_SESSION_BODY)
        assert [agent.status_code, environment.status_code, stored.status_code, session.status_code] == [
            200, 201, 200, 200,
        ]
        turns = client.get(f"/v1/agents/sessions/{session.json()['id']}/turns")
        (turn,) = turns.json()["data"]
    return {
        "agent_id": agent.json()["id"],
        "environment_id": environment.json()["id"],
        "file_id": stored.json()["id"],
        "session_id": session.json()["id"],
        "turn_id": turn["id"],
    }


# One test per route of the gateway (the document covers exactly these);
# deletes last, so the other operations find the shared objects.
_OPERATIONS = sorted(OPERATIONS, key=lambda op: (op[0] == "DELETE", op))


@pytest.mark.parametrize(("method", "path"), _OPERATIONS, ids=[f"{m} {p}" for m, p in _OPERATIONS])
def test_every_operation_answers_generated_requests_as_documented(
    live_stack: Stack, api_schema: Any, resources: dict[str, str], method: str, path: str
) -> None:
    operation = api_schema[path][method]
    # Valid requests and invalid ones (wrong types, missing fields...), the
    # invalid ones must be 4xx, never 5xx; and valid ones on real objects.
    strategies = [operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE)]
    names = re.findall(r"\{(\w+)\}", path)
    if names and all(name in resources for name in names):
        known = {name: resources[name] for name in names}
        strategies.append(operation.as_strategy(GenerationMode.POSITIVE, path_parameters=known))

    @hypothesis.given(case=hypothesis.strategies.one_of(strategies))
    @hypothesis.settings(_SETTINGS, max_examples=_EXAMPLES_PER_OPERATION)
    def run(case: Case[Any]) -> None:
        case.call_and_validate(headers=_auth(live_stack), checks=CHECKS)

    run()


def test_stateful_scenarios_along_the_links_answer_as_documented(live_stack: Stack) -> None:
    config = schemathesis.Config.from_str(_CONFIG)
    api_schema: Any = schemathesis.openapi.from_url(_origin(live_stack) + OPENAPI_PATH, config=config)

    @api_schema.hook  # type: ignore[untyped-decorator]
    def map_body(context: Any, body: Any) -> Any:
        if context.operation is None or context.operation.label != "POST /v1/agents/sessions":
            return body
        kept = {k: v for k, v in body.items() if k in _SESSION_KEYS_KEPT} if isinstance(body, dict) else {}
        return {**kept, **_SESSION_BODY}

    answered: Counter[tuple[str, int]] = Counter()

    class Workflow(api_schema.as_state_machine()):  # type: ignore[misc]
        def get_call_kwargs(self, case: Case[Any]) -> dict[str, Any]:
            return {"headers": _auth(live_stack)}

        def after_call(self, response: Response, case: Case[Any]) -> None:
            answered[(f"{case.method} {case.path}", response.status_code)] += 1

        def validate_response(
            self, response: Response, case: Case[Any], additional_checks: Any = None, **kwargs: Any
        ) -> None:
            try:
                case.validate_response(response, checks=CHECKS, transport_kwargs=kwargs or None)
            except FailureGroup as exc:
                failures.append(exc)
                raise

    failures: list[FailureGroup] = []
    try:
        Workflow.run(settings=hypothesis.settings(_SETTINGS, max_examples=_STATEFUL_SCENARIOS, stateful_step_count=8))
    except hypothesis.errors.Flaky:
        # Scenarios draw from responses (IDs, list contents) that differ on
        # a replay; as in schemathesis' own engine, that alone fails nothing.
        # A check that failed does.
        if failures:
            raise failures[0] from None
    # The links were followed: an operation on a created resource succeeded.
    followed = {op for (op, status), _ in answered.items() if "{" in op and 200 <= status < 300}
    assert followed, sorted(answered.items())


def test_the_document_links_creates_to_the_operations_on_what_they_create(live_stack: Stack) -> None:
    document = httpx.get(_origin(live_stack) + OPENAPI_PATH, timeout=10).json()
    links = document["paths"]["/v1/agents"]["post"]["responses"]["200"]["links"]
    assert set(links) == {"retrieve_agent", "update_agent", "delete_agent"}
    session_links = document["paths"]["/v1/agents/sessions"]["post"]["responses"]["200"]["links"]
    assert {"create_events", "stream_events", "list_turns", "list_items"} <= set(session_links)
    assert session_links["list_turns"]["parameters"] == {"path.session_id": "$response.body#/id"}
