"""Thin gRPC servicer for the Sandbox service: protos in, manager calls, protos out."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from berth.common.v1 import common_pb2
from berth.sandbox.v1 import sandbox_pb2, sandbox_service_pb2 as pb, sandbox_service_pb2_grpc
from services.core.context import current_org
from services.core.errors import InvalidArgument
from services.sandbox.daemon_client import (
    DaemonClient,
    ExitStatus,
    FileEntry,
    McpBrokerInfo,
    McpHttpTransport,
    McpStdioTransport,
    McpTransport,
    OutputChunk,
    ProcessInfo,
)
from services.sandbox.manager import CreateParams, SandboxManager, SandboxRecord, SecretParams
from services.sandbox.states import McpBrokerState, mcp_broker_state_to_proto, sandbox_state_to_proto

__all__ = ["SandboxServicer"]

_ACCESS = {
    common_pb2.NETWORK_ACCESS_UNSPECIFIED: "enabled",
    common_pb2.NETWORK_ACCESS_ENABLED: "enabled",
    common_pb2.NETWORK_ACCESS_DISABLED: "disabled",
    common_pb2.NETWORK_ACCESS_RESTRICTED: "restricted",
}
_ACCESS_BACK = {v: k for k, v in _ACCESS.items() if k != common_pb2.NETWORK_ACCESS_UNSPECIFIED}
_FILE_TYPES = {"file": common_pb2.FILE_TYPE_FILE, "dir": common_pb2.FILE_TYPE_DIRECTORY, "symlink": common_pb2.FILE_TYPE_SYMLINK}
_STREAMS = {"stdout": common_pb2.OUTPUT_STREAM_STDOUT, "stderr": common_pb2.OUTPUT_STREAM_STDERR}
_READ_CHUNK = 1024 * 1024
_MCP_TRANSPORTS = {"stdio": sandbox_pb2.MCP_TRANSPORT_TYPE_STDIO, "http": sandbox_pb2.MCP_TRANSPORT_TYPE_HTTP}
# Without a caller deadline a tool call may run long; the gRPC deadline, when
# set, fires first and cancels the request upstream.
_MCP_DEFAULT_TIMEOUT_S = 3600.0


def _ts(seconds: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def _strings(value: object) -> list[str]:
    return [str(v) for v in value] if isinstance(value, list) else []


def _sandbox(rec: SandboxRecord) -> sandbox_pb2.Sandbox:
    network = rec.network
    return sandbox_pb2.Sandbox(
        sandbox_id=rec.sandbox_id,
        state=sandbox_state_to_proto(rec.state),
        backend=rec.backend,
        labels=rec.labels,
        network=common_pb2.NetworkPolicy(
            access=_ACCESS_BACK.get(str(network.get("access", "enabled")), common_pb2.NETWORK_ACCESS_ENABLED),
            allowed_domains=_strings(network.get("allowed_domains")),
            blocked_domains=_strings(network.get("blocked_domains")),
        ),
        error=rec.error,
        create_time=_ts(rec.created_at),
        last_active_time=_ts(rec.last_active_at),
        isolation=rec.isolation,
        size=rec.size,
    )


def _secrets(substitutions: Iterable[sandbox_pb2.SecretSubstitution]) -> tuple[SecretParams, ...]:
    return tuple(
        SecretParams(
            env_name=secret.env_name,
            value=secret.value,
            any_allowed_host=secret.any_allowed_host,
            allowed_hosts=tuple(secret.allowed_hosts),
            credential_id=secret.credential_id,
        )
        for secret in substitutions
    )


def _labeled(rec: SandboxRecord, label_key: str) -> sandbox_pb2.LabeledSandbox:
    return sandbox_pb2.LabeledSandbox(
        sandbox_id=rec.sandbox_id,
        org_id=rec.org_id,
        label_value=rec.labels.get(label_key, ""),
        state=sandbox_state_to_proto(rec.state),
        create_time=_ts(rec.created_at),
    )


def _entry(e: FileEntry) -> common_pb2.FileEntry:
    return common_pb2.FileEntry(
        path=e.path, type=_FILE_TYPES.get(e.type, common_pb2.FILE_TYPE_UNSPECIFIED), size_bytes=e.size, mode=e.mode, mtime=e.mtime
    )


def _process(p: ProcessInfo) -> sandbox_pb2.Process:
    proc = sandbox_pb2.Process(
        process_id=p.process_id,
        name=p.name,
        pid=p.pid,
        running=p.running,
        keepalive=p.keepalive,
        start_time=_ts(p.started_at),
        next_seq=p.next_seq,
        stdin_open=p.stdin_open,
    )
    if not p.running and p.exit_code is not None:
        proc.exit.CopyFrom(common_pb2.ExitStatus(exit_code=p.exit_code))
    return proc


def _command(argv: list[str], shell: str) -> tuple[list[str] | None, str | None]:
    if bool(argv) == bool(shell):
        raise InvalidArgument("exactly one of argv and shell is required", param="argv")
    return (list(argv) or None), (shell or None)


def _chunk(ev: OutputChunk) -> common_pb2.OutputChunk:
    return common_pb2.OutputChunk(stream=_STREAMS.get(ev.stream, common_pb2.OUTPUT_STREAM_UNSPECIFIED), seq=ev.seq, data=ev.data)


def _exit(ev: ExitStatus) -> common_pb2.ExitStatus:
    return common_pb2.ExitStatus(exit_code=ev.exit_code, timed_out=ev.timed_out, duration_ms=ev.duration_ms)


def _mcp_broker(b: McpBrokerInfo) -> sandbox_pb2.McpBroker:
    broker = sandbox_pb2.McpBroker(
        label=b.label,
        transport_type=_MCP_TRANSPORTS.get(b.transport, sandbox_pb2.MCP_TRANSPORT_TYPE_UNSPECIFIED),
        state=mcp_broker_state_to_proto(b.state),
        pid=b.pid or 0,
        start_time=_ts(b.started_at),
        clients=b.clients,
        in_flight=b.in_flight,
        stderr_tail=b.stderr_tail,
    )
    if b.state == McpBrokerState.DEAD and b.exit_code is not None:
        broker.exit.CopyFrom(common_pb2.ExitStatus(exit_code=b.exit_code))
    return broker


def _mcp_transport(request: pb.StartMcpBrokerRequest) -> McpTransport | None:
    """None when the caller only joins an existing broker; the daemon rejects
    that if the label has none yet."""
    if not request.HasField("transport"):
        return None
    which = request.transport.WhichOneof("transport")
    if which == "stdio":
        stdio = request.transport.stdio
        return McpStdioTransport(
            command=stdio.command, args=list(stdio.args), cwd=stdio.cwd or None, env=dict(stdio.env), env_vars=list(stdio.env_vars)
        )
    if which == "http":
        return McpHttpTransport(server_url=request.transport.http.server_url, headers=dict(request.transport.http.headers))
    raise InvalidArgument("transport needs stdio or http", param="transport")


def _mcp_message(text: str) -> dict[str, Any]:
    try:
        message = json.loads(text)
    except ValueError:
        raise InvalidArgument("message_json is not valid JSON", param="message_json") from None
    if not isinstance(message, dict):
        raise InvalidArgument("message_json must be one JSON-RPC message object", param="message_json")
    return message


async def _start(client: DaemonClient, request: pb.StartProcessRequest) -> ProcessInfo:
    argv, shell = _command(list(request.argv), request.shell)
    return await client.start_process(
        name=request.name or "process",
        argv=argv,
        shell=shell,
        cwd=request.cwd or None,
        env=dict(request.env),
        keepalive=request.keepalive,
        stdin=request.stdin,
        by_name=request.by_name,
    )


class SandboxServicer(sandbox_service_pb2_grpc.SandboxServiceServicer):
    def __init__(self, manager: SandboxManager) -> None:
        self._m = manager

    async def CreateSandbox(self, request: pb.CreateSandboxRequest, context: grpc.aio.ServicerContext) -> pb.CreateSandboxResponse:
        params = CreateParams(
            sandbox_id=request.sandbox_id,
            labels=dict(request.labels),
            network={
                "access": _ACCESS[request.network.access],
                "allowed_domains": list(request.network.allowed_domains),
                "blocked_domains": list(request.network.blocked_domains),
            },
            env=dict(request.env),
            size=int(request.size),
            secrets=_secrets(request.secret_substitutions),
        )
        return pb.CreateSandboxResponse(sandbox=_sandbox(await self._m.create(current_org(), params)))

    async def GetSandbox(self, request: pb.GetSandboxRequest, context: grpc.aio.ServicerContext) -> pb.GetSandboxResponse:
        return pb.GetSandboxResponse(sandbox=_sandbox(await self._m.get(current_org(), request.sandbox_id)))

    async def ListLabeledSandboxes(
        self, request: pb.ListLabeledSandboxesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListLabeledSandboxesResponse:
        records, token = await self._m.list_labeled(request.label_key, request.page_size, request.page_token)
        return pb.ListLabeledSandboxesResponse(
            sandboxes=[_labeled(r, request.label_key) for r in records], next_page_token=token
        )

    async def CountSandboxes(self, request: pb.CountSandboxesRequest, context: grpc.aio.ServicerContext) -> pb.CountSandboxesResponse:
        return pb.CountSandboxesResponse(live_count=await self._m.count_live())

    async def Exec(self, request: pb.ExecRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ExecResponse]:
        argv, shell = _command(list(request.argv), request.shell)
        async with self._m.operation(current_org(), request.sandbox_id) as client:
            stream = client.exec(
                argv=argv,
                shell=shell,
                cwd=request.cwd or None,
                env=dict(request.env),
                timeout_s=request.timeout_ms / 1000 if request.timeout_ms else None,
                stdin=request.stdin or None,
            )
            try:
                async for ev in stream:
                    if isinstance(ev, OutputChunk):
                        yield pb.ExecResponse(chunk=_chunk(ev))
                    else:
                        yield pb.ExecResponse(exit=_exit(ev))
            finally:
                await stream.aclose()

    async def StartProcess(self, request: pb.StartProcessRequest, context: grpc.aio.ServicerContext) -> pb.StartProcessResponse:
        async with self._m.operation(current_org(), request.sandbox_id) as client:
            info = await _start(client, request)
        return pb.StartProcessResponse(process=_process(info))

    async def RunProcess(self, request: pb.RunProcessRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.RunProcessResponse]:
        start = request.start
        # One operation for both: the sandbox is not idle-paused in between.
        async with self._m.operation(current_org(), start.sandbox_id) as client:
            info = await _start(client, start)
            yield pb.RunProcessResponse(process=_process(info))
            stream = client.attach_process(info.process_id, from_seq=0)
            try:
                async for ev in stream:
                    if isinstance(ev, OutputChunk):
                        yield pb.RunProcessResponse(chunk=_chunk(ev))
                    else:
                        yield pb.RunProcessResponse(exit=_exit(ev))
            finally:
                await stream.aclose()

    async def AttachProcess(self, request: pb.AttachProcessRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.AttachProcessResponse]:
        async with self._m.operation(current_org(), request.sandbox_id) as client:
            stream = client.attach_process(request.process_id, from_seq=request.from_seq)
            try:
                async for ev in stream:
                    if isinstance(ev, OutputChunk):
                        yield pb.AttachProcessResponse(chunk=_chunk(ev))
                    else:
                        yield pb.AttachProcessResponse(exit=_exit(ev))
            finally:
                await stream.aclose()

    async def KillProcess(self, request: pb.KillProcessRequest, context: grpc.aio.ServicerContext) -> pb.KillProcessResponse:
        async with self._m.operation(current_org(), request.sandbox_id) as client:
            proc = await client.kill_process(request.process_id, signal=request.signal or 9)
        return pb.KillProcessResponse(process=_process(proc) if proc else None)

    async def WriteProcessStdin(
        self, request: pb.WriteProcessStdinRequest, context: grpc.aio.ServicerContext
    ) -> pb.WriteProcessStdinResponse:
        async with self._m.operation(current_org(), request.sandbox_id) as client:
            proc = await client.write_stdin(request.process_id, request.data, close=request.close)
        return pb.WriteProcessStdinResponse(process=_process(proc))

    async def RemoveFile(self, request: pb.RemoveFileRequest, context: grpc.aio.ServicerContext) -> pb.RemoveFileResponse:
        async with self._m.operation(current_org(), request.sandbox_id) as client:
            await client.remove(request.path)
        return pb.RemoveFileResponse()

    async def MakeDirectory(self, request: pb.MakeDirectoryRequest, context: grpc.aio.ServicerContext) -> pb.MakeDirectoryResponse:
        async with self._m.operation(current_org(), request.sandbox_id) as client:
            await client.mkdir(request.path, parents=True)
        return pb.MakeDirectoryResponse()

    async def ListProcesses(self, request: pb.ListProcessesRequest, context: grpc.aio.ServicerContext) -> pb.ListProcessesResponse:
        async with self._m.operation(current_org(), request.sandbox_id) as client:
            procs = await client.list_processes()
        return pb.ListProcessesResponse(processes=[_process(p) for p in procs])

    async def WriteFile(self, request: pb.WriteFileRequest, context: grpc.aio.ServicerContext) -> pb.WriteFileResponse:
        async with self._m.operation(current_org(), request.sandbox_id) as client:
            await client.write_file(request.path, request.data, mode=request.mode or None, append=request.append)
            entry = await client.stat(request.path)
        return pb.WriteFileResponse(entry=_entry(entry))

    async def ReadFile(self, request: pb.ReadFileRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ReadFileResponse]:
        async with self._m.operation(current_org(), request.sandbox_id) as client:
            entry = await client.stat(request.path)
            first = True
            stream = client.read_file(request.path)
            try:
                async for data in stream:
                    yield pb.ReadFileResponse(data=data, size_bytes=entry.size if first else 0)
                    first = False
            finally:
                await stream.aclose()
            if first:
                yield pb.ReadFileResponse(data=b"", size_bytes=entry.size)

    async def ListFiles(self, request: pb.ListFilesRequest, context: grpc.aio.ServicerContext) -> pb.ListFilesResponse:
        async with self._m.operation(current_org(), request.sandbox_id) as client:
            entries = await client.list_files(request.path or "/workspace", recursive=request.recursive)
        return pb.ListFilesResponse(entries=[_entry(e) for e in entries])

    async def UpdateSecretSubstitutions(
        self, request: pb.UpdateSecretSubstitutionsRequest, context: grpc.aio.ServicerContext
    ) -> pb.UpdateSecretSubstitutionsResponse:
        applied, ignored = await self._m.update_secrets(
            current_org(), request.sandbox_id, _secrets(request.secret_substitutions)
        )
        return pb.UpdateSecretSubstitutionsResponse(credential_ids=applied, ignored_credential_ids=ignored)

    async def DestroySandbox(self, request: pb.DestroySandboxRequest, context: grpc.aio.ServicerContext) -> pb.DestroySandboxResponse:
        await self._m.destroy(current_org(), request.sandbox_id)
        return pb.DestroySandboxResponse()

    async def StartMcpBroker(self, request: pb.StartMcpBrokerRequest, context: grpc.aio.ServicerContext) -> pb.StartMcpBrokerResponse:
        transport = _mcp_transport(request)
        async with self._m.operation(current_org(), request.sandbox_id) as client:
            info = await client.mcp_start(request.label, transport)
        return pb.StartMcpBrokerResponse(broker=_mcp_broker(info), created=info.created)

    async def ListMcpBrokers(self, request: pb.ListMcpBrokersRequest, context: grpc.aio.ServicerContext) -> pb.ListMcpBrokersResponse:
        async with self._m.mcp_operation(current_org(), request.sandbox_id) as (client, http):
            brokers = await client.mcp_list()
            for i, info in enumerate(brokers):
                served = http.known(info.label) if info.transport == "http" else None
                if served is not None:
                    # sandboxd registers HTTP labels; their callers are here.
                    described = served.describe()
                    brokers[i] = dataclasses.replace(info, clients=described["clients"], in_flight=described["in_flight"])
        return pb.ListMcpBrokersResponse(brokers=[_mcp_broker(b) for b in brokers])

    async def SendMcpMessage(self, request: pb.SendMcpMessageRequest, context: grpc.aio.ServicerContext) -> pb.SendMcpMessageResponse:
        message = _mcp_message(request.message_json)
        remaining = context.time_remaining()
        timeout_s = _MCP_DEFAULT_TIMEOUT_S if remaining is None else remaining + 1.0
        is_request = "method" in message and "id" in message
        async with self._m.mcp_operation(current_org(), request.sandbox_id) as (client, http):
            broker = await http.broker(request.label)
            if broker is not None:
                if is_request:
                    response = await http.request(broker, message)
                    return pb.SendMcpMessageResponse(message_json=json.dumps(response, separators=(",", ":")))
                await http.notify(broker, message)
                return pb.SendMcpMessageResponse()
            if is_request:
                response = await client.mcp_request(request.label, message, timeout_s=timeout_s)
                return pb.SendMcpMessageResponse(message_json=json.dumps(response, separators=(",", ":")))
            await client.mcp_notify(request.label, message)
        return pb.SendMcpMessageResponse()

    async def StopMcpBroker(self, request: pb.StopMcpBrokerRequest, context: grpc.aio.ServicerContext) -> pb.StopMcpBrokerResponse:
        async with self._m.mcp_operation(current_org(), request.sandbox_id) as (client, http):
            broker = await http.broker(request.label)
            if broker is not None:
                await broker.stop()  # ends the upstream session first
            info = await client.mcp_stop(request.label)
        return pb.StopMcpBrokerResponse(broker=_mcp_broker(info))

    async def CloseMcpUpstream(self, request: pb.CloseMcpUpstreamRequest, context: grpc.aio.ServicerContext) -> pb.CloseMcpUpstreamResponse:
        async with self._m.mcp_operation(current_org(), request.sandbox_id) as (client, http):
            broker = await http.broker(request.label)
            closed = await broker.close_upstream() if broker is not None else await client.mcp_close_upstream(request.label)
        return pb.CloseMcpUpstreamResponse(closed=closed)
