"""The turn's environment: setup before its first use, with the pending,
ready and failed events around it, and the harness's ``EnvironmentPort``
over the Environment service."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from sqlalchemy import update

from berth.common.v1 import common_pb2
from berth.environment.v1 import environment_pb2, environment_service_pb2
from services.core.errors import BerthError, EnvironmentFailed
from services.session import wire
from services.session.environment_client import EnvironmentClient
from services.session.harness.environment import CommandEvent, CommandExit, CommandOutput, Process
from services.session.harness.io import TurnFailure
from services.session.models import SessionRow
from services.session.store import Unit
from services.session.turn_writer import TurnWriter

__all__ = ["TurnEnvironment", "sandbox_failure"]


def sandbox_failure(environment_id: str | None, session_id: str, exc: BaseException) -> TurnFailure:
    """A failed environment call as a turn failure naming the session and environment."""
    detail = exc.message if isinstance(exc, BerthError) else str(exc)
    return TurnFailure("sandbox_error", f"environment {environment_id} of session {session_id} failed: {detail}")


def _exit(status: common_pb2.ExitStatus) -> CommandExit:
    return CommandExit(status.exit_code, status.timed_out, int(status.duration_ms))


def _command_event(
    message: environment_service_pb2.ExecCommandResponse | environment_service_pb2.AttachProcessResponse,
) -> CommandEvent | None:
    kind = message.WhichOneof("event")
    if kind == "chunk":
        return CommandOutput(message.chunk.data, int(message.chunk.seq))
    if kind == "exit":
        return _exit(message.exit)
    return None


def _process(process: environment_pb2.Process) -> Process:
    return Process(
        process_id=process.process_id,
        name=process.name,
        running=process.running,
        exit=_exit(process.exit) if process.HasField("exit") else None,
        next_seq=int(process.next_seq),
        stdin_open=process.stdin_open,
    )


class TurnEnvironment:
    """One session's environment during one of its turns. It implements
    ``EnvironmentPort``; ``environment`` is the last snapshot read."""

    def __init__(
        self,
        writer: TurnWriter,
        client: EnvironmentClient,
        *,
        environment_id: str,
        environment: environment_pb2.Environment | None,
    ) -> None:
        self._writer = writer
        self._client = client
        self.environment_id = environment_id
        self.environment = environment
        self.ready = False

    # ----- the port ---------------------------------------------------------------
    async def exec(self, shell: str, *, cwd: str, timeout_ms: int) -> AsyncGenerator[CommandEvent, None]:
        call = self._client.exec_command(
            self.environment_id, self._writer.session_id, shell=shell, cwd=cwd, timeout_ms=timeout_ms
        )
        try:
            async for message in call:
                event = _command_event(message)
                if event is not None:
                    yield event
        finally:
            # Reached on cancellation or early close as well: cancelling the
            # call kills the command's process tree in the sandbox.
            call.cancel()

    async def read_file(self, path: str, *, limit: int) -> tuple[bytes, bool]:
        return await self._client.read_file(self.environment_id, path, limit=limit)

    async def write_file(self, path: str, data: bytes) -> None:
        await self._client.write_file(self.environment_id, path, data)

    async def remove_file(self, path: str) -> None:
        await self._client.remove_file(self.environment_id, path)

    async def start_process(
        self, shell: str, *, name: str, cwd: str, keepalive: bool, stdin: bool = False
    ) -> Process:
        process = await self._client.start_process(
            self.environment_id,
            self._writer.session_id,
            name=name,
            shell=shell,
            cwd=cwd,
            keepalive=keepalive,
            stdin=stdin,
        )
        return _process(process)

    async def write_stdin(self, process_id: str, data: bytes, *, close: bool) -> Process:
        return _process(await self._client.write_process_stdin(self.environment_id, process_id, data, close=close))

    async def process_output(self, process_id: str, *, from_seq: int) -> AsyncGenerator[CommandEvent, None]:
        call = self._client.attach_process(self.environment_id, process_id, from_seq=from_seq)
        try:
            async for message in call:
                event = _command_event(message)
                if event is not None:
                    yield event
        finally:
            # Stops only the stream: the process keeps running.
            call.cancel()

    async def kill_process(self, process_id: str) -> Process | None:
        process = await self._client.kill_process(self.environment_id, process_id)
        return _process(process) if process is not None else None

    async def list_processes(self) -> list[Process]:
        return [_process(p) for p in await self._client.list_processes(self.environment_id)]

    # ----- setup ------------------------------------------------------------------
    def failure(self, exc: BaseException) -> TurnFailure:
        return sandbox_failure(self.environment_id, self._writer.session_id, exc)

    async def _failed(self, env: environment_pb2.Environment | None, message: str) -> TurnFailure:
        w = self._writer
        code = env.error.code if env is not None and env.error.code else "setup_failed"
        state = wire.environment_state(self.environment_id, "failed", (code, message))

        async def record(u: Unit) -> None:
            await u.session.execute(update(SessionRow).where(SessionRow.id == w.session_id).values(error=message))
            failed = wire.environment_event("agent.session.environment.failed", w.session_id, w.turn_id, state)
            await w.append(u, [failed])

        await w.transact(record)
        return TurnFailure("sandbox_error", message)

    async def ensure_ready(self) -> None:
        """Before the first environment operation of a turn: pending/ready
        events around setup; raises TurnFailure("sandbox_error") when setup failed."""
        if self.ready:
            return
        w = self._writer
        if self.environment is not None and self.environment.status == environment_pb2.ENVIRONMENT_STATUS_READY:
            # Read when the turn was claimed; a ready environment stays ready.
            self.ready = True
            return
        try:
            env = await self._client.get_environment(self.environment_id)
        except BerthError as exc:
            raise self.failure(exc) from exc
        self.environment = env
        if env.status == environment_pb2.ENVIRONMENT_STATUS_READY:
            self.ready = True
            return
        if env.status == environment_pb2.ENVIRONMENT_STATUS_FAILED:
            raise await self._failed(env, env.error.message or "environment setup failed")
        await w.emit(
            wire.environment_event(
                "agent.session.environment.pending",
                w.session_id,
                w.turn_id,
                wire.environment_state(self.environment_id, "pending"),
            )
        )
        try:
            env = await self._client.ensure_ready(self.environment_id)
        except EnvironmentFailed as exc:
            raise await self._failed(None, exc.message) from exc
        except BerthError as exc:
            raise self.failure(exc) from exc
        self.environment = env
        if env.status != environment_pb2.ENVIRONMENT_STATUS_READY:
            raise await self._failed(env, env.error.message or "environment setup failed")
        self.ready = True
        await w.emit(
            wire.environment_event(
                "agent.session.environment.ready",
                w.session_id,
                w.turn_id,
                wire.environment_state(self.environment_id, "ready"),
            )
        )
