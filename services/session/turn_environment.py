"""The turn's environment: setup before its first use, with the pending,
ready and failed events around it, and the harness's ``EnvironmentPort``
over the Environment service.

A call that finds the Environment or Sandbox service UNAVAILABLE (down or
restarting) is made again, with backoff, for ``retry_s`` before it fails
the turn (``services.core.grpc_client.call_until_available``); meanwhile
the turn's events say ``agent.session.environment.disconnected``, then
``agent.session.environment.connected`` when it answers. A command is only
started again when its first attempt sent nothing back; a background
process's output is reattached from the next sequence number it had not
sent, so no output is lost or repeated."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

from sqlalchemy import update

from berth.common.v1 import common_pb2
from berth.environment.v1 import environment_pb2, environment_service_pb2
from services.core.errors import BerthError, EnvironmentFailed, Unavailable
from services.core.grpc_client import call_until_available, peer_unavailable
from services.session import wire
from services.session.environment_client import EnvironmentClient, process_request
from services.session.harness.environment import CommandEvent, CommandExit, CommandOutput, Process
from services.session.harness.io import TurnFailure
from services.session.models import SessionRow
from services.session.store import Unit
from services.session.turn_writer import TurnWriter

__all__ = ["TurnEnvironment", "sandbox_failure"]

T = TypeVar("T")


def sandbox_failure(environment_id: str | None, session_id: str, exc: BaseException) -> TurnFailure:
    """A failed environment call as a turn failure naming the session and environment."""
    detail = exc.message if isinstance(exc, BerthError) else str(exc)
    return TurnFailure("sandbox_error", f"environment {environment_id} of session {session_id} failed: {detail}")


def _command_name(key: str) -> str:
    """The background process name of a keyed command."""
    return f"exec-{key}"


def _exit(status: common_pb2.ExitStatus) -> CommandExit:
    return CommandExit(status.exit_code, status.timed_out, int(status.duration_ms))


def _command_event(
    message: (
        environment_service_pb2.ExecCommandResponse
        | environment_service_pb2.AttachProcessResponse
        | environment_service_pb2.RunProcessResponse
    ),
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
        retry_s: float = 0.0,
    ) -> None:
        self._writer = writer
        self._client = client
        self.environment_id = environment_id
        self.environment = environment
        self.ready = False
        self._retry_s = retry_s
        # Set when this process stops running the turn and another will
        # resume it: keyed commands are then left running, not killed.
        self.detached = False

    # ----- waiting out an unavailable dependency ------------------------------------
    async def _disconnected(self, exc: Unavailable) -> None:
        w = self._writer
        state = wire.environment_state(self.environment_id, "disconnected", ("sandbox_unavailable", exc.message))
        await w.emit(wire.environment_event("agent.session.environment.disconnected", w.session_id, w.turn_id, state))

    async def _connected(self) -> None:
        w = self._writer
        state = wire.environment_state(self.environment_id, "connected")
        await w.emit(wire.environment_event("agent.session.environment.connected", w.session_id, w.turn_id, state))

    async def _call(self, call: Callable[[], Awaitable[T]]) -> T:
        return await call_until_available(
            call, within_s=self._retry_s, on_disconnected=self._disconnected, on_connected=self._connected
        )

    async def _stream(self, open_call: Callable[[], Any], *, resumable: Callable[[], bool]) -> AsyncGenerator[Any, None]:
        """The messages of a server stream. A stream that fails UNAVAILABLE
        is opened again (``open_call`` is called anew) while ``resumable()``
        says that loses and repeats nothing, within the retry bound."""
        calls: list[Any] = []
        streams: list[Any] = []

        async def first_message() -> Any:
            call = open_call()
            calls.append(call)
            streams.append(call.__aiter__())
            return await streams[-1].__anext__()

        try:
            while True:
                try:
                    first = await (self._call(first_message) if resumable() else first_message())
                except StopAsyncIteration:
                    return
                try:
                    yield first
                    async for message in streams[-1]:
                        yield message
                    return
                except Unavailable as exc:
                    if not peer_unavailable(exc) or not resumable() or self._retry_s <= 0:
                        raise
        finally:
            # Reached on cancellation or early close as well.
            for call in calls:
                call.cancel()

    # ----- the port ---------------------------------------------------------------
    async def exec(
        self, shell: str, *, cwd: str, timeout_ms: int, key: str = ""
    ) -> AsyncGenerator[CommandEvent, None]:
        if key:
            async with contextlib.aclosing(self._exec_process(shell, cwd=cwd, timeout_ms=timeout_ms, key=key)) as keyed:
                async for command_event in keyed:
                    yield command_event
            return
        received = False

        def open_call() -> Any:
            return self._client.exec_command(
                self.environment_id, self._writer.session_id, shell=shell, cwd=cwd, timeout_ms=timeout_ms
            )

        # Cancelling the call (closing this generator) kills the command's
        # process tree in the sandbox. Only a command that sent nothing back
        # is started again.
        async with contextlib.aclosing(self._stream(open_call, resumable=lambda: not received)) as messages:
            async for message in messages:
                received = True
                event = _command_event(message)
                if event is not None:
                    yield event

    async def _exec_process(self, shell: str, *, cwd: str, timeout_ms: int, key: str) -> AsyncGenerator[CommandEvent, None]:
        """A keyed command runs as a background process named by its key, so
        it outlives this process and a resumed turn reattaches to it through
        the daemon's lossless output log. Starting is idempotent by the name
        (``by_name``, decided in sandboxd): a start whose answer was lost, or
        a dead worker's start that reaches the sandbox after the resumed
        turn's, finds the process the other started instead of a second run.
        It is started and followed in one call (RunProcess)."""
        name = _command_name(key)

        request = process_request(self.environment_id, self._writer.session_id, name=name, shell=shell, cwd=cwd, by_name=True)

        def start() -> Any:
            return self._client.run_process(request)

        async with contextlib.aclosing(self._command_events(start, "", timeout_ms=timeout_ms)) as events:
            async for event in events:
                yield event

    async def reattach(self, key: str) -> AsyncGenerator[CommandEvent, None] | None:
        process = await self._call(lambda: self._named(_command_name(key)))
        if process is None:
            return None
        return self._command_events(None, process.process_id, timeout_ms=0)

    async def _named(self, name: str) -> environment_pb2.Process | None:
        for process in await self._client.list_processes(self.environment_id):
            if process.name == name:
                return process
        return None

    async def _command_events(
        self, start: Callable[[], Any] | None, process_id: str, *, timeout_ms: int
    ) -> AsyncGenerator[CommandEvent, None]:
        """A command process's output from its start and its exit: started
        by ``start`` (a RunProcess call, whose first message names the
        process), or, without it, the process ``process_id``. A broken
        stream is opened again: as the start (idempotent by name) while no
        process was named, then as an attach from the first chunk not yet
        delivered. The process is killed after ``timeout_ms`` (0: no bound),
        and when the reader stops before its exit (unless the turn is
        ``detached``)."""
        known = process_id
        next_seq = 0
        timer: asyncio.Task[None] | None = None
        exited = False

        def named(found: str) -> None:
            nonlocal known, timer
            known = found
            if timeout_ms > 0 and timer is None:
                timer = asyncio.create_task(self._kill_after(found, timeout_ms / 1000))

        def open_call() -> Any:
            if known or start is None:
                return self._client.attach_process(self.environment_id, known, from_seq=next_seq)
            return start()

        if known:
            named(known)
        try:
            async with contextlib.aclosing(self._stream(open_call, resumable=lambda: True)) as messages:
                async for message in messages:
                    kind = message.WhichOneof("event")
                    if kind == "process":
                        if not known:
                            named(message.process.process_id)
                        continue
                    if kind == "chunk":
                        next_seq = int(message.chunk.seq) + 1
                    event = _command_event(message)
                    if isinstance(event, CommandExit):
                        exited = True
                        timed_out = event.timed_out or (timer is not None and timer.done() and not timer.cancelled())
                        yield CommandExit(event.exit_code, timed_out, event.duration_ms)
                        return
                    if event is not None:
                        yield event
        finally:
            if timer is not None:
                timer.cancel()
            if known and not exited and not self.detached:
                with contextlib.suppress(BerthError):
                    await asyncio.shield(self._client.kill_process(self.environment_id, known))

    async def _kill_after(self, process_id: str, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        await self._call(lambda: self._client.kill_process(self.environment_id, process_id))

    async def read_file(self, path: str, *, limit: int) -> tuple[bytes, bool]:
        return await self._call(lambda: self._client.read_file(self.environment_id, path, limit=limit))

    async def write_file(self, path: str, data: bytes) -> None:
        await self._call(lambda: self._client.write_file(self.environment_id, path, data))

    async def remove_file(self, path: str) -> None:
        await self._call(lambda: self._client.remove_file(self.environment_id, path))

    async def start_process(
        self, shell: str, *, name: str, cwd: str, keepalive: bool, stdin: bool = False
    ) -> Process:
        # Not repeated: a start whose answer was lost may have started it.
        process = await self._client.start_process(
            process_request(
                self.environment_id, self._writer.session_id, name=name, shell=shell, cwd=cwd, keepalive=keepalive, stdin=stdin
            )
        )
        return _process(process)

    async def write_stdin(self, process_id: str, data: bytes, *, close: bool) -> Process:
        return _process(await self._client.write_process_stdin(self.environment_id, process_id, data, close=close))

    async def process_output(self, process_id: str, *, from_seq: int) -> AsyncGenerator[CommandEvent, None]:
        next_seq = from_seq

        def open_call() -> Any:
            return self._client.attach_process(self.environment_id, process_id, from_seq=next_seq)

        # Closing the stream leaves the process running; a broken one is
        # reattached from the first chunk it had not delivered.
        async with contextlib.aclosing(self._stream(open_call, resumable=lambda: True)) as messages:
            async for message in messages:
                if message.WhichOneof("event") == "chunk":
                    next_seq = int(message.chunk.seq) + 1
                event = _command_event(message)
                if event is not None:
                    yield event

    async def kill_process(self, process_id: str) -> Process | None:
        process = await self._call(lambda: self._client.kill_process(self.environment_id, process_id))
        return _process(process) if process is not None else None

    async def list_processes(self) -> list[Process]:
        return [_process(p) for p in await self._call(lambda: self._client.list_processes(self.environment_id))]

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
            env = await self._call(lambda: self._client.get_environment(self.environment_id))
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
            env = await self._call(lambda: self._client.ensure_ready(self.environment_id))
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
