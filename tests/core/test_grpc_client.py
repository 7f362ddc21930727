"""The client side of service-to-service calls: domain errors come back as
the domain error classes, and retries follow the protos' idempotency marks."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_support import TEST_INTERNAL_TOKEN, credentials
from grpc_health.v1 import health_pb2

from berth.environment.v1 import environment_service_pb2
from berth.sandbox.v1 import sandbox_service_pb2, sandbox_service_pb2_grpc
from berth.session.v1 import session_service_pb2
from services.core import errors
from services.core.context import org_metadata
from services.core.grpc_client import service_config
from services.core.grpc_server import RunningServer, open_channel, start_grpc_server
from services.core.interceptors import allowed_callers

_SANDBOX = sandbox_service_pb2.DESCRIPTOR.services_by_name["SandboxService"]
_SERVICES = [
    _SANDBOX,
    environment_service_pb2.DESCRIPTOR.services_by_name["EnvironmentService"],
    session_service_pb2.DESCRIPTOR.services_by_name["SessionService"],
]
_MARKED = (descriptor_pb2.MethodOptions.IDEMPOTENT, descriptor_pb2.MethodOptions.NO_SIDE_EFFECTS)


def _configured(config: str) -> tuple[set[tuple[str, str]], list[dict[str, Any]]]:
    method_config = json.loads(config).get("methodConfig", [])
    names = {(name["service"], name["method"]) for entry in method_config for name in entry["name"]}
    return names, [entry["retryPolicy"] for entry in method_config]


def test_the_retry_config_covers_exactly_the_methods_the_protos_mark_idempotent() -> None:
    names, policies = _configured(service_config(_SERVICES))
    marked = {
        (service.full_name, method.name)
        for service in _SERVICES
        for method in service.methods
        if method.GetOptions().idempotency_level in _MARKED
    }
    assert names == marked
    # Reads are marked; calls with effects that are not idempotent are not.
    assert ("berth.environment.v1.EnvironmentService", "GetEnvironment") in names
    assert ("berth.session.v1.SessionService", "ListItems") in names
    assert ("berth.sandbox.v1.SandboxService", "CreateSandbox") in names
    assert ("berth.session.v1.SessionService", "SubmitSessionEvents") not in names
    assert ("berth.sandbox.v1.SandboxService", "Exec") not in names
    assert ("berth.sandbox.v1.SandboxService", "CountSandboxes") not in names
    assert policies and all(policy["retryableStatusCodes"] == ["UNAVAILABLE"] for policy in policies)


def test_the_health_check_is_retried_and_a_service_without_marks_gets_no_retries() -> None:
    names, _ = _configured(service_config([health_pb2.DESCRIPTOR.services_by_name["Health"]]))
    assert names == {("grpc.health.v1.Health", "Check")}
    assert _configured(service_config([]))[0] == set()


class _Flaky(sandbox_service_pb2_grpc.SandboxServiceServicer):
    """Answers UNAVAILABLE (as a proxy in front of a restarting peer would,
    with no retry pushback) ``failures`` times per method, then succeeds."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.attempts: dict[str, int] = {}
        # What WriteFile raises.
        self.error: errors.BerthError = errors.PathOutsideWorkspace("the path leaves the workspace", param="path")

    async def _attempt(self, method: str, context: grpc.aio.ServicerContext) -> None:
        self.attempts[method] = self.attempts.get(method, 0) + 1
        if self.attempts[method] <= self.failures:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "not yet")

    async def ListFiles(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        await self._attempt("ListFiles", context)
        return sandbox_service_pb2.ListFilesResponse()

    async def StartMcpBroker(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        await self._attempt("StartMcpBroker", context)
        return sandbox_service_pb2.StartMcpBrokerResponse()

    async def WriteFile(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        raise self.error

    async def ReadFile(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:  # noqa: N802
        yield sandbox_service_pb2.ReadFileResponse(data=b"first", size_bytes=10)
        raise errors.NotFound(f"sandbox {request.sandbox_id} not found")


async def _serve(servicer: _Flaky) -> RunningServer:
    def register(server: grpc.aio.Server) -> list[str]:
        sandbox_service_pb2_grpc.add_SandboxServiceServicer_to_server(servicer, server)
        return [_SANDBOX.full_name]

    callers = allowed_callers(_SANDBOX, {"environment": [method.name for method in _SANDBOX.methods]})
    return await start_grpc_server("127.0.0.1:0", register, token=TEST_INTERNAL_TOKEN, callers=callers)


@pytest.fixture
async def flaky() -> AsyncIterator[tuple[_Flaky, sandbox_service_pb2_grpc.SandboxServiceStub]]:
    servicer = _Flaky(failures=2)
    running = await _serve(servicer)
    channel = open_channel(
        f"127.0.0.1:{running.port}",
        timeout_s=10,
        credentials=credentials("environment"),
        services=[_SANDBOX],
        domain_errors=True,
    )
    try:
        yield servicer, sandbox_service_pb2_grpc.SandboxServiceStub(channel)
    finally:
        await channel.close()
        await running.stop(0)


async def test_an_idempotent_call_is_retried_on_unavailable(flaky: Any) -> None:
    servicer, stub = flaky
    await stub.ListFiles(sandbox_service_pb2.ListFilesRequest(sandbox_id="sbx-1"), metadata=org_metadata("org-1"))
    assert servicer.attempts["ListFiles"] == 3


async def test_a_call_not_marked_idempotent_is_not_retried_and_fails_as_unavailable(flaky: Any) -> None:
    servicer, stub = flaky
    with pytest.raises(errors.Unavailable) as raised:
        await stub.StartMcpBroker(
            sandbox_service_pb2.StartMcpBrokerRequest(sandbox_id="sbx-1", label="x"), metadata=org_metadata("org-1")
        )
    assert servicer.attempts["StartMcpBroker"] == 1
    assert raised.value.received_code == grpc.StatusCode.UNAVAILABLE


async def test_a_failed_call_raises_the_domain_error_the_server_raised(flaky: Any) -> None:
    _, stub = flaky
    with pytest.raises(errors.PathOutsideWorkspace) as raised:
        await stub.WriteFile(sandbox_service_pb2.WriteFileRequest(sandbox_id="sbx-1", path="/x"), metadata=org_metadata("org-1"))
    assert raised.value.param == "path"
    assert raised.value.received_code == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_failed_stream_raises_the_domain_error_after_the_messages_it_sent(flaky: Any) -> None:
    _, stub = flaky
    received: list[bytes] = []
    with pytest.raises(errors.NotFound):
        async for message in stub.ReadFile(
            sandbox_service_pb2.ReadFileRequest(sandbox_id="sbx-1", path="/x"), metadata=org_metadata("org-1")
        ):
            received.append(message.data)
    assert received == [b"first"]


async def test_a_channel_without_domain_errors_raises_the_grpc_error(flaky: Any) -> None:
    servicer, _ = flaky
    running = await _serve(servicer)
    channel = open_channel(f"127.0.0.1:{running.port}", timeout_s=10, credentials=credentials("environment"))
    try:
        stub = sandbox_service_pb2_grpc.SandboxServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.WriteFile(sandbox_service_pb2.WriteFileRequest(sandbox_id="sbx-1"), metadata=org_metadata("org-1"))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await channel.close()
        await running.stop(0)


_CROSSING: list[type[errors.BerthError]] = sorted(
    set(errors._BY_REASON.values()) - {errors.PeerUnauthenticated, errors.PeerNotAllowed}, key=lambda c: c.reason
)


@pytest.mark.parametrize("cls", _CROSSING)
async def test_every_domain_error_crosses_a_hop_as_its_own_class(flaky: Any, cls: type[errors.BerthError]) -> None:
    servicer, stub = flaky
    servicer.error = cls("it failed", param="path")
    with pytest.raises(cls) as raised:
        await stub.WriteFile(sandbox_service_pb2.WriteFileRequest(sandbox_id="sbx-1", path="/x"), metadata=org_metadata("org-1"))
    assert type(raised.value) is cls and raised.value.param == "path"


# --- waiting out an unavailable dependency -----------------------------------------------


def _unavailable(code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> errors.Unavailable:
    error = errors.SandboxUnavailable("down")
    error.received_code = code
    return error


async def test_a_dependency_that_comes_back_is_waited_for_and_the_wait_is_announced_once_each_way() -> None:
    from services.core.grpc_client import call_until_available

    attempts: list[int] = []
    seen: list[str] = []

    async def call() -> str:
        attempts.append(1)
        if len(attempts) < 4:
            raise _unavailable()
        return "answer"

    async def disconnected(exc: errors.Unavailable) -> None:
        seen.append(f"disconnected:{exc.reason}")

    async def connected() -> None:
        seen.append("connected")

    result = await call_until_available(
        call, within_s=10, on_disconnected=disconnected, on_connected=connected, first_backoff_s=0.01
    )
    assert (result, len(attempts), seen) == ("answer", 4, ["disconnected:SANDBOX_UNAVAILABLE", "connected"])


async def test_a_dependency_unavailable_past_the_bound_raises_its_last_failure() -> None:
    from services.core.grpc_client import call_until_available

    attempts: list[int] = []

    async def call() -> None:
        attempts.append(1)
        raise _unavailable()

    with pytest.raises(errors.SandboxUnavailable):
        await call_until_available(call, within_s=0.1, first_backoff_s=0.01, max_backoff_s=0.02)
    assert len(attempts) > 1


@pytest.mark.parametrize(
    "error",
    [_unavailable(grpc.StatusCode.DEADLINE_EXCEEDED), errors.SandboxUnavailable("raised here"), errors.NotFound("gone")],
    ids=["deadline", "not-received", "not-found"],
)
async def test_only_a_call_that_ended_unavailable_is_made_again(error: errors.BerthError) -> None:
    from services.core.grpc_client import call_until_available

    attempts: list[int] = []

    async def call() -> None:
        attempts.append(1)
        raise error

    with pytest.raises(type(error)):
        await call_until_available(call, within_s=10, first_backoff_s=0.01)
    assert len(attempts) == 1
