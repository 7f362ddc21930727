"""gRPC servicer: protos in, domain calls, protos out. Domain errors pass
through to the interceptor, which maps them to statuses."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TypeAlias

import grpc
from google.protobuf import timestamp_pb2

from berth.common.v1 import common_pb2
from berth.environment.v1 import environment_pb2, environment_service_pb2 as pb, environment_service_pb2_grpc
from berth.sandbox.v1 import sandbox_pb2
from services.core.context import current_org
from services.environment.compute import ProcessStart
from services.environment.domain import EnvironmentDomain, LiveFile
from services.environment.file_store import FileStore
from services.environment.mcp_registry import McpServerInfo
from services.environment.models import (
    LIFETIME_SHARED,
    ROLE_OWNER,
    BindingRow,
    EnvironmentRow,
    RegisteredFileRow,
    StoredFileRow,
    TemplateRow,
)
from services.environment.templates import EnvironmentTemplates
from services.environment.states import EnvironmentStatus, environment_status_to_proto

__all__ = ["EnvironmentServicer", "environment_to_proto", "template_to_proto"]

_Context: TypeAlias = grpc.aio.ServicerContext


def _timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def environment_to_proto(row: EnvironmentRow, *, with_config: bool = True) -> environment_pb2.Environment:
    env = environment_pb2.Environment(
        id=row.id,
        org_id=row.org_id,
        status=environment_status_to_proto(row.status),
        lifetime=environment_pb2.LIFETIME_SHARED if row.lifetime == LIFETIME_SHARED else environment_pb2.LIFETIME_PRIVATE,
        sandbox_id=row.sandbox_id,
        vault_ids=json.loads(row.vault_ids_json),
        owner_session_id=row.owner_session_id,
        session_count=row.session_count,
        create_time=_timestamp(row.create_time),
        update_time=_timestamp(row.update_time),
        init_version=row.init_version,
        ever_shared=row.ever_shared,
    )
    if with_config:
        env.config.ParseFromString(row.config)
        for command in env.config.setup_commands:
            command.command = ""  # confidential: bodies never leave the service
    if row.status == EnvironmentStatus.FAILED:
        env.error.code = row.error_code
        env.error.message = row.error_message
    return env


def template_to_proto(row: TemplateRow) -> environment_pb2.EnvironmentTemplate:
    template = environment_pb2.EnvironmentTemplate(
        id=row.id,
        org_id=row.org_id,
        create_time=_timestamp(row.create_time),
        update_time=_timestamp(row.update_time),
    )
    if row.name is not None:
        template.name = row.name
    template.config.ParseFromString(row.config)
    for command in template.config.setup_commands:
        command.command = ""  # confidential: bodies never leave the service
    for f in template.config.files:
        if f.WhichOneof("source") == "data":
            f.data = b""  # size_bytes says what callers may know
    return template


def _binding(row: BindingRow) -> environment_pb2.Binding:
    return environment_pb2.Binding(
        environment_id=row.environment_id,
        session_id=row.session_id,
        role=environment_pb2.BINDING_ROLE_OWNER if row.role == ROLE_OWNER else environment_pb2.BINDING_ROLE_REFERENCE,
        output_dir=row.output_dir,
        create_time=_timestamp(row.create_time),
    )


def _registered(row: RegisteredFileRow | LiveFile) -> environment_pb2.RegisteredFile:
    return environment_pb2.RegisteredFile(
        environment_id=row.environment_id,
        path=row.path,
        size_bytes=row.size_bytes,
        source=row.source,
        file_id=row.file_id,
        id=row.id,
    )


def _stored(row: StoredFileRow) -> environment_pb2.StoredFile:
    out = environment_pb2.StoredFile(
        id=row.id,
        filename=row.filename,
        purpose=row.purpose,
        size_bytes=row.size_bytes,
        create_time=_timestamp(row.create_time),
        sha256=row.sha256,
    )
    if row.expire_time is not None:
        out.expire_time.CopyFrom(_timestamp(row.expire_time))
    return out


_MCP_STATES = {
    "running": environment_pb2.MCP_SERVER_STATE_RUNNING,
    "dead": environment_pb2.MCP_SERVER_STATE_DEAD,
}
_MCP_TRANSPORTS = {
    "stdio": environment_pb2.MCP_TRANSPORT_TYPE_STDIO,
    "http": environment_pb2.MCP_TRANSPORT_TYPE_HTTP,
}


def _process(process: sandbox_pb2.Process) -> environment_pb2.Process:
    return environment_pb2.Process(
        process_id=process.process_id,
        name=process.name,
        pid=process.pid,
        running=process.running,
        exit=process.exit if process.HasField("exit") else None,
        keepalive=process.keepalive,
        start_time=process.start_time if process.HasField("start_time") else None,
        next_seq=process.next_seq,
        stdin_open=process.stdin_open,
    )


def _start(request: pb.StartProcessRequest) -> ProcessStart:
    """A StartProcess request's process (RunProcess carries one too)."""
    return ProcessStart(
        name=request.name or "process",
        argv=list(request.argv),
        shell=request.shell,
        cwd=request.cwd,
        env=dict(request.env),
        keepalive=request.keepalive,
        stdin=request.stdin,
        by_name=request.by_name,
    )


def _mcp_server(info: McpServerInfo) -> environment_pb2.McpServer:
    return environment_pb2.McpServer(
        environment_id=info.environment_id,
        label=info.label,
        origin=info.origin,
        transport_type=_MCP_TRANSPORTS.get(info.transport_type, environment_pb2.MCP_TRANSPORT_TYPE_UNSPECIFIED),
        owner_session_id=info.owner_session_id,
        state=_MCP_STATES.get(info.state, environment_pb2.MCP_SERVER_STATE_UNSPECIFIED),
        create_time=_timestamp(info.create_time),
        session_ids=info.session_ids,
        pid=info.pid,
    )


class EnvironmentServicer(environment_service_pb2_grpc.EnvironmentServiceServicer):
    def __init__(self, domain: EnvironmentDomain, file_store: FileStore, templates: EnvironmentTemplates) -> None:
        self._domain = domain
        self._files = file_store
        self._templates = templates

    async def CreateEnvironment(
        self, request: pb.CreateEnvironmentRequest, context: _Context
    ) -> pb.CreateEnvironmentResponse:
        org = current_org()
        config = await self._templates.resolve(org, request.config)
        row, binding = await self._domain.create_environment(
            org, config, list(request.vault_ids), request.owner_session_id
        )
        response = pb.CreateEnvironmentResponse(environment=environment_to_proto(row))
        if binding is not None:
            response.binding.CopyFrom(_binding(binding))
        return response

    async def CreateEnvironmentTemplate(
        self, request: pb.CreateEnvironmentTemplateRequest, context: _Context
    ) -> pb.CreateEnvironmentTemplateResponse:
        name = request.name if request.HasField("name") else None
        row = await self._templates.create(current_org(), request.config, name)
        return pb.CreateEnvironmentTemplateResponse(template=template_to_proto(row))

    async def GetEnvironmentTemplate(
        self, request: pb.GetEnvironmentTemplateRequest, context: _Context
    ) -> pb.GetEnvironmentTemplateResponse:
        row = await self._templates.get(current_org(), request.template_id)
        return pb.GetEnvironmentTemplateResponse(template=template_to_proto(row))

    async def ListEnvironmentTemplates(
        self, request: pb.ListEnvironmentTemplatesRequest, context: _Context
    ) -> pb.ListEnvironmentTemplatesResponse:
        rows, has_more = await self._templates.list(
            current_org(), page_size=request.page_size, after=request.after, order=request.order
        )
        return pb.ListEnvironmentTemplatesResponse(templates=[template_to_proto(r) for r in rows], has_more=has_more)

    async def UpdateEnvironmentTemplate(
        self, request: pb.UpdateEnvironmentTemplateRequest, context: _Context
    ) -> pb.UpdateEnvironmentTemplateResponse:
        row = await self._templates.update(
            current_org(),
            request.template_id,
            request.config,
            list(request.update_fields),
            update_name=request.update_name,
            name=request.name if request.HasField("name") else None,
        )
        return pb.UpdateEnvironmentTemplateResponse(template=template_to_proto(row))

    async def DeleteEnvironmentTemplate(
        self, request: pb.DeleteEnvironmentTemplateRequest, context: _Context
    ) -> pb.DeleteEnvironmentTemplateResponse:
        await self._templates.delete(current_org(), request.template_id)
        return pb.DeleteEnvironmentTemplateResponse(template_id=request.template_id)

    async def GetEnvironment(self, request: pb.GetEnvironmentRequest, context: _Context) -> pb.GetEnvironmentResponse:
        row = await self._domain.get_environment(current_org(), request.environment_id)
        return pb.GetEnvironmentResponse(environment=environment_to_proto(row))

    async def ListEnvironments(self, request: pb.ListEnvironmentsRequest, context: _Context) -> pb.ListEnvironmentsResponse:
        rows, has_more = await self._domain.list_environments(
            current_org(), page_size=request.page_size, after=request.after, order=request.order
        )
        return pb.ListEnvironmentsResponse(environments=[environment_to_proto(r) for r in rows], has_more=has_more)

    async def DeleteEnvironment(
        self, request: pb.DeleteEnvironmentRequest, context: _Context
    ) -> pb.DeleteEnvironmentResponse:
        await self._domain.delete_environment(current_org(), request.environment_id)
        return pb.DeleteEnvironmentResponse(environment_id=request.environment_id)

    async def AttachSession(self, request: pb.AttachSessionRequest, context: _Context) -> pb.AttachSessionResponse:
        row, binding = await self._domain.attach_session(current_org(), request.environment_id, request.session_id)
        return pb.AttachSessionResponse(environment=environment_to_proto(row), binding=_binding(binding))

    async def DetachSession(self, request: pb.DetachSessionRequest, context: _Context) -> pb.DetachSessionResponse:
        deleted = await self._domain.detach_session(current_org(), request.environment_id, request.session_id)
        return pb.DetachSessionResponse(environment_deleted=deleted)

    async def GetBinding(self, request: pb.GetBindingRequest, context: _Context) -> pb.GetBindingResponse:
        binding = await self._domain.get_binding(current_org(), request.environment_id, request.session_id)
        return pb.GetBindingResponse(binding=_binding(binding))

    async def EnsureEnvironmentReady(
        self, request: pb.EnsureEnvironmentReadyRequest, context: _Context
    ) -> pb.EnsureEnvironmentReadyResponse:
        row = await self._domain.ensure_ready(current_org(), request.environment_id)
        return pb.EnsureEnvironmentReadyResponse(environment=environment_to_proto(row))

    async def ExecCommand(self, request: pb.ExecCommandRequest, context: _Context) -> AsyncIterator[pb.ExecCommandResponse]:
        events = self._domain.exec_command(
            current_org(),
            request.environment_id,
            session_id=request.session_id,
            argv=list(request.argv),
            shell=request.shell,
            cwd=request.cwd,
            env=dict(request.env),
            timeout_ms=request.timeout_ms,
        )
        async for event in events:
            if isinstance(event, common_pb2.ExitStatus):
                yield pb.ExecCommandResponse(exit=event)
            else:
                yield pb.ExecCommandResponse(chunk=event)

    async def ReadWorkspaceFile(
        self, request: pb.ReadWorkspaceFileRequest, context: _Context
    ) -> AsyncIterator[pb.ReadWorkspaceFileResponse]:
        async for data, size in self._domain.read_workspace_file(current_org(), request.environment_id, request.path):
            yield pb.ReadWorkspaceFileResponse(data=data, size_bytes=size)

    async def WriteWorkspaceFile(
        self, request: pb.WriteWorkspaceFileRequest, context: _Context
    ) -> pb.WriteWorkspaceFileResponse:
        entry = await self._domain.write_workspace_file(current_org(), request.environment_id, request.path, request.data)
        return pb.WriteWorkspaceFileResponse(entry=entry)

    async def ListWorkspaceFiles(
        self, request: pb.ListWorkspaceFilesRequest, context: _Context
    ) -> pb.ListWorkspaceFilesResponse:
        entries = await self._domain.list_workspace_files(
            current_org(), request.environment_id, request.path, recursive=request.recursive
        )
        return pb.ListWorkspaceFilesResponse(entries=entries)

    async def ListSessionOutputs(
        self, request: pb.ListSessionOutputsRequest, context: _Context
    ) -> pb.ListSessionOutputsResponse:
        outputs = await self._domain.list_session_outputs(current_org(), request.environment_id, request.session_id)
        environment = environment_to_proto(outputs.environment) if outputs.environment is not None else None
        return pb.ListSessionOutputsResponse(output_dir=outputs.output_dir, entries=outputs.entries, environment=environment)

    async def CreateEnvironmentFile(
        self, request: pb.CreateEnvironmentFileRequest, context: _Context
    ) -> pb.CreateEnvironmentFileResponse:
        source = request.WhichOneof("source")
        row = await self._domain.create_environment_file(
            current_org(),
            request.environment_id,
            request.path,
            data=request.data if source == "data" else None,
            file_id=request.file_id if source == "file_id" else None,
        )
        return pb.CreateEnvironmentFileResponse(file=_registered(row))

    async def ListEnvironmentFiles(
        self, request: pb.ListEnvironmentFilesRequest, context: _Context
    ) -> pb.ListEnvironmentFilesResponse:
        files, token = await self._domain.list_environment_files(
            current_org(),
            request.environment_id,
            path=request.path,
            order=request.order,
            page_size=request.page_size,
            page_token=request.page_token,
        )
        return pb.ListEnvironmentFilesResponse(files=[_registered(f) for f in files], next_page_token=token)

    async def CreateStoredFile(self, request: pb.CreateStoredFileRequest, context: _Context) -> pb.CreateStoredFileResponse:
        row = await self._files.create(
            current_org(),
            filename=request.filename,
            purpose=request.purpose,
            data=request.data,
            expires_after_s=request.expires_after_s,
        )
        return pb.CreateStoredFileResponse(file=_stored(row))

    async def GetStoredFile(self, request: pb.GetStoredFileRequest, context: _Context) -> pb.GetStoredFileResponse:
        return pb.GetStoredFileResponse(file=_stored(await self._files.get(current_org(), request.file_id)))

    async def GetStoredFileContent(
        self, request: pb.GetStoredFileContentRequest, context: _Context
    ) -> AsyncIterator[pb.GetStoredFileContentResponse]:
        async for chunk in self._files.chunks(current_org(), request.file_id):
            yield pb.GetStoredFileContentResponse(data=chunk)

    async def DeleteStoredFile(self, request: pb.DeleteStoredFileRequest, context: _Context) -> pb.DeleteStoredFileResponse:
        await self._files.delete(current_org(), request.file_id)
        return pb.DeleteStoredFileResponse(file_id=request.file_id)

    async def ListStoredFiles(self, request: pb.ListStoredFilesRequest, context: _Context) -> pb.ListStoredFilesResponse:
        rows, has_more = await self._files.list(
            current_org(), page_size=request.page_size, after=request.after, purpose=request.purpose
        )
        return pb.ListStoredFilesResponse(files=[_stored(r) for r in rows], has_more=has_more)

    async def StartMcpServer(self, request: pb.StartMcpServerRequest, context: _Context) -> pb.StartMcpServerResponse:
        info, created = await self._domain.start_mcp_server(
            current_org(),
            request.environment_id,
            request.session_id,
            request.label,
            request.transport_json,
            credential_id=request.credential_id,
        )
        return pb.StartMcpServerResponse(server=_mcp_server(info), created=created)

    async def SendMcpMessage(self, request: pb.SendMcpMessageRequest, context: _Context) -> pb.SendMcpMessageResponse:
        response = await self._domain.send_mcp_message(
            current_org(),
            request.environment_id,
            request.session_id,
            request.label,
            request.message_json,
            timeout_s=context.time_remaining(),
        )
        return pb.SendMcpMessageResponse(response_json=response)

    async def ListMcpServers(self, request: pb.ListMcpServersRequest, context: _Context) -> pb.ListMcpServersResponse:
        servers = await self._domain.list_mcp_servers(current_org(), request.environment_id)
        return pb.ListMcpServersResponse(servers=[_mcp_server(s) for s in servers])

    async def StartProcess(self, request: pb.StartProcessRequest, context: _Context) -> pb.StartProcessResponse:
        process = await self._domain.start_process(
            current_org(), request.environment_id, session_id=request.session_id, start=_start(request)
        )
        return pb.StartProcessResponse(process=_process(process))

    async def RunProcess(self, request: pb.RunProcessRequest, context: _Context) -> AsyncIterator[pb.RunProcessResponse]:
        start = request.start
        events = self._domain.run_process(current_org(), start.environment_id, session_id=start.session_id, start=_start(start))
        async for event in events:
            if isinstance(event, sandbox_pb2.Process):
                yield pb.RunProcessResponse(process=_process(event))
            elif isinstance(event, common_pb2.ExitStatus):
                yield pb.RunProcessResponse(exit=event)
            else:
                yield pb.RunProcessResponse(chunk=event)

    async def AttachProcess(self, request: pb.AttachProcessRequest, context: _Context) -> AsyncIterator[pb.AttachProcessResponse]:
        events = self._domain.attach_process(
            current_org(), request.environment_id, request.process_id, from_seq=request.from_seq
        )
        async for event in events:
            if isinstance(event, common_pb2.ExitStatus):
                yield pb.AttachProcessResponse(exit=event)
            else:
                yield pb.AttachProcessResponse(chunk=event)

    async def KillProcess(self, request: pb.KillProcessRequest, context: _Context) -> pb.KillProcessResponse:
        process = await self._domain.kill_process(
            current_org(), request.environment_id, request.process_id, signal=request.signal
        )
        return pb.KillProcessResponse(process=_process(process) if process is not None else None)

    async def WriteProcessStdin(
        self, request: pb.WriteProcessStdinRequest, context: _Context
    ) -> pb.WriteProcessStdinResponse:
        process = await self._domain.write_process_stdin(
            current_org(), request.environment_id, request.process_id, request.data, close=request.close
        )
        return pb.WriteProcessStdinResponse(process=_process(process))

    async def RemoveWorkspaceFile(
        self, request: pb.RemoveWorkspaceFileRequest, context: _Context
    ) -> pb.RemoveWorkspaceFileResponse:
        await self._domain.remove_workspace_file(current_org(), request.environment_id, request.path)
        return pb.RemoveWorkspaceFileResponse()

    async def ListProcesses(self, request: pb.ListProcessesRequest, context: _Context) -> pb.ListProcessesResponse:
        processes = await self._domain.list_processes(current_org(), request.environment_id)
        return pb.ListProcessesResponse(processes=[_process(p) for p in processes])
