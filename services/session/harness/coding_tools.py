"""The coding-agent environment tools, in the style of the Codex CLI's:

- ``apply_patch``: edits, adds, deletes and moves files with the Codex patch
  format (``harness/patch.py``), all or nothing.
- ``start_process``: starts a shell command in the background, waits up to
  ``yield_time_ms`` for it and returns its ``process_id``, whether it still
  runs, and the output so far; the process keeps running after the call and
  after the turn.
- ``write_stdin``: writes to a running process's stdin (optionally closing
  it), waits up to ``yield_time_ms`` and returns the output since the last
  read. With no ``chars`` it only polls.
- ``kill_process``: kills a process and its whole tree.

Each call is one ``command_execution`` item (the SDK's
``AgentCommandExecutionItem``, parsed strictly): the command, its output in
this call, ``exit_code`` once the process has exited; its output streams as
``command_execution_output.delta`` events.

Which processes a session may address: background processes belong to the
environment and, like its files, are shared by every session on it (the
seeds). The model of a session may address only the processes started by
that session's turns (their name is ``session:<session_id>``); another
process ID is an unknown process to it. The read position is per session
too: it is kept on the tool's transcript entry, so each read continues where
the session's previous read of that process ended, across turns.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import posixpath
import time
from dataclasses import dataclass
from typing import Any

from services.core.errors import BerthError
from services.session.harness.environment import CommandExit, CommandOutput, Process, model_fault
from services.session.harness.io import ItemHandle, TurnIO
from services.session.harness.models.base import ToolCall, ToolSpec
from services.session.harness.patch import PatchError, apply_patch
from services.session.harness.tool_output import MAX_ITEM_OUTPUT, MAX_MODEL_OUTPUT, call_entries, clip_for_model

__all__ = ["CODING_TOOLS", "CODING_TOOL_NAMES", "run_coding_tool", "process_name"]

WORKSPACE = "/workspace"
DEFAULT_START_YIELD_MS = 10_000
DEFAULT_WRITE_YIELD_MS = 250
MAX_YIELD_MS = 300_000
# The most output bytes one call reads from a process; the rest waits for the next read.
MAX_READ_PER_CALL = 1024 * 1024
# The transcript-entry key that records a process call's read position.
_CURSOR_KEY = "process"

CODING_TOOLS = [
    ToolSpec(
        name="apply_patch",
        description=(
            "Edit files with a patch. The input starts with '*** Begin Patch' and ends with '*** End Patch'. "
            "In between, one or more file sections: '*** Add File: PATH' followed by the new file's lines, each "
            "prefixed with '+'; '*** Delete File: PATH'; or '*** Update File: PATH', optionally followed by "
            "'*** Move to: NEW_PATH', then hunks. A hunk starts with '@@' (optionally followed by a line of the "
            "file to find first, such as a function's signature), then lines prefixed with ' ' (context, about 3 "
            "lines before and after a change), '-' (removed) or '+' (added). '*** End of File' ends a hunk at the "
            "end of the file. Paths are relative to /workspace. Either the whole patch applies or nothing changes."
        ),
        parameters={
            "type": "object",
            "properties": {"input": {"type": "string", "description": "The entire patch."}},
            "required": ["input"],
        },
    ),
    ToolSpec(
        name="start_process",
        description=(
            "Start a shell command (sh -c) in the background in the environment. Waits up to yield_time_ms for "
            "it (returning early if it exits) and returns its process_id, whether it is still running (or its "
            "exit code) and its output so far. The process keeps running after the call; use write_stdin to "
            "send it input or read more output, and kill_process to stop it. Its stdin is a pipe: a program "
            "that reads until end of file waits until write_stdin closes it."
        ),
        parameters={
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": "The shell command."},
                "cwd": {"type": "string", "description": "Working directory; default /workspace."},
                "yield_time_ms": {
                    "type": "integer",
                    "description": f"How long to wait for output before returning; default {DEFAULT_START_YIELD_MS}.",
                },
            },
            "required": ["command"],
        },
    ),
    ToolSpec(
        name="write_stdin",
        description=(
            "Write chars to the stdin of a process started with start_process, then wait up to yield_time_ms "
            "and return the output it wrote since the last read, and whether it is still running. With no "
            "chars it only reads. Set close_stdin to close its stdin after writing (the process reads end of file)."
        ),
        parameters={
            "type": "object",
            "properties": {
                "process_id": {"type": "string", "description": "The process_id start_process returned."},
                "chars": {"type": "string", "description": "Text to write, e.g. a line ending in \\n; may be empty."},
                "close_stdin": {"type": "boolean", "description": "Close stdin after writing; default false."},
                "yield_time_ms": {
                    "type": "integer",
                    "description": f"How long to wait for output before returning; default {DEFAULT_WRITE_YIELD_MS}.",
                },
            },
            "required": ["process_id"],
        },
    ),
    ToolSpec(
        name="kill_process",
        description="Kill a process started with start_process, and every process it started.",
        parameters={
            "type": "object",
            "properties": {"process_id": {"type": "string", "description": "The process_id start_process returned."}},
            "required": ["process_id"],
        },
    ),
]
CODING_TOOL_NAMES = frozenset(t.name for t in CODING_TOOLS)


def process_name(session_id: str) -> str:
    """The name of a background process a session's model started."""
    return f"session:{session_id}"


class _Refused(Exception):
    """The call cannot run as given; the message is for the model."""


@dataclass
class _Call:
    io: TurnIO
    call: ToolCall
    item: dict[str, Any]
    handle: ItemHandle | None = None
    # Extra keys of the transcript entry (the read position of a process).
    extra: dict[str, Any] | None = None

    async def open(self) -> None:
        self.handle = await self.io.add_item(self.item, entries=[], output=True, done=False)
        self.io.track_item(self.handle, self.item)

    async def finish(self, model_output: str) -> None:
        entries = call_entries(self.call, model_output, **(self.extra or {}))
        if self.handle is None:
            await self.io.add_item(self.item, entries=entries, output=True, done=True)
        else:
            await self.io.finish_item(self.handle, self.item, entries=entries)


def _arguments(call: ToolCall) -> dict[str, Any]:
    try:
        value = json.loads(call.arguments or "{}")
    except ValueError:
        raise _Refused(f"invalid arguments for {call.name}: not a JSON object") from None
    if not isinstance(value, dict):
        raise _Refused(f"invalid arguments for {call.name}: not a JSON object")
    return value


def _string(args: dict[str, Any], key: str, *, required: bool) -> str:
    value = args.get(key)
    if value is None or value == "":
        if required:
            raise _Refused(f"'{key}' is required")
        return ""
    if not isinstance(value, str):
        raise _Refused(f"'{key}' must be a string")
    return value


def _yield_ms(args: dict[str, Any], default: int) -> int:
    value = args.get("yield_time_ms")
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _Refused("'yield_time_ms' must be a non-negative integer")
    return min(value, MAX_YIELD_MS)


def _item(command: str, cwd: str = WORKSPACE) -> dict[str, Any]:
    return {
        "type": "command_execution",
        "command": command,
        "cwd": cwd,
        "status": "in_progress",
        "exit_code": None,
        "output": None,
        "duration_ms": None,
    }


def _command_of(call: ToolCall) -> str:
    try:
        args = json.loads(call.arguments or "{}")
    except ValueError:
        args = None
    if isinstance(args, dict):
        if call.name == "start_process" and isinstance(args.get("command"), str):
            return str(args["command"])
        if isinstance(args.get("process_id"), str):
            return f"{call.name} {args['process_id']}"
    return call.name


async def run_coding_tool(io: TurnIO, call: ToolCall) -> None:
    """Runs one call of a tool in CODING_TOOL_NAMES to completion. A call
    the model got wrong ends with an error the model is told; an
    environment that cannot be used fails the turn (``sandbox_error``)."""
    started = time.monotonic()
    state = _Call(io, call, _item(_command_of(call)))
    try:
        if io.environment_id is None or io.env is None:
            raise _Refused("this session has no environment; environment tools are unavailable")
        args = _arguments(call)
        if call.name == "apply_patch":
            output = await _apply_patch(state, args)
        elif call.name == "start_process":
            output = await _start_process(state, args)
        elif call.name == "write_stdin":
            output = await _write_stdin(state, args)
        else:
            output = await _kill_process(state, args)
    except _Refused as refused:
        message = f"error: {refused}"
        state.item.update(status="failed", output=message)
        output = message
    except BerthError as exc:
        if not model_fault(exc):
            raise io.sandbox_failure(exc) from exc
        message = f"error: {exc.message}"
        state.item.update(status="failed", output=message)
        output = message
    state.item["duration_ms"] = int((time.monotonic() - started) * 1000)
    await state.finish(output)


# ----------------------------------------------------------------- apply_patch


async def _apply_patch(state: _Call, args: dict[str, Any]) -> str:
    patch = _string(args, "input", required=True)
    io = state.io
    assert io.env is not None
    await io.ensure_environment()
    await state.open()
    try:
        result = await apply_patch(io.env, patch)
    except PatchError as exc:
        raise _Refused(f"the patch was not applied, nothing changed: {exc}") from None
    summary = result.summary()
    state.item.update(
        command="apply_patch " + " ".join(path for _, path in result.changes),
        status="completed",
        exit_code=0,
        output=summary,
    )
    return summary


# ----------------------------------------------------------------- processes


def _cursor(transcript: list[dict[str, Any]], process_id: str) -> int:
    """Where this session's last read of the process ended."""
    for entry in reversed(transcript):
        mark = entry.get(_CURSOR_KEY)
        if isinstance(mark, dict) and mark.get("id") == process_id and isinstance(mark.get("next_seq"), int):
            return int(mark["next_seq"])
    return 0


async def _owned(io: TurnIO, process_id: str) -> Process:
    assert io.env is not None
    for process in await io.env.list_processes():
        if process.process_id == process_id and process.name == process_name(io.session_id):
            return process
    raise _Refused(f"no process {process_id} was started by this session")


@dataclass
class _Read:
    text: str
    # The sequence number after the last chunk read.
    next_seq: int
    exit: CommandExit | None
    # The read stopped at MAX_READ_PER_CALL with the process still writing.
    capped: bool


async def _read(state: _Call, process_id: str, from_seq: int, yield_ms: int) -> _Read:
    """The process's output from ``from_seq`` for up to ``yield_ms`` (less
    if it exits), streamed as output deltas of the call's item."""
    io, handle = state.io, state.handle
    assert io.env is not None and handle is not None
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    parts: list[str] = []
    size = 0
    next_seq = from_seq
    exit_event: CommandExit | None = None
    events = io.env.process_output(process_id, from_seq=from_seq)
    # Closing the stream on the deadline leaves the process running.
    async with contextlib.aclosing(events):
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(yield_ms / 1000):
                async for event in events:
                    if isinstance(event, CommandExit):
                        exit_event = event
                        break
                    if not isinstance(event, CommandOutput):
                        continue
                    next_seq = event.seq + 1 if event.seq is not None else next_seq + 1
                    size += len(event.data)
                    text = decoder.decode(event.data)
                    if text:
                        parts.append(text)
                        if sum(len(p) for p in parts) <= MAX_ITEM_OUTPUT:
                            state.item["output"] = "".join(parts)
                            io.track_item(handle, state.item)
                        await io.emit(
                            {
                                "type": "agent.output.command_execution_output.delta",
                                "item_id": handle.id,
                                "output_index": handle.output_index,
                                "delta": text,
                            }
                        )
                    if size >= MAX_READ_PER_CALL:
                        break
    parts.append(decoder.decode(b"", final=True))
    capped = exit_event is None and size >= MAX_READ_PER_CALL
    return _Read("".join(parts), next_seq, exit_event, capped)


def _report(state: _Call, process_id: str, read: _Read, stdin_open: bool) -> str:
    """Fills in the item and returns the model's text for a process read."""
    text = read.text
    item_text = text if len(text) <= MAX_ITEM_OUTPUT else text[:MAX_ITEM_OUTPUT] + "\n...[output truncated]"
    if read.exit is not None:
        status = f"exited with code {read.exit.exit_code}"
        state.item.update(
            status="completed" if read.exit.exit_code == 0 else "failed", exit_code=read.exit.exit_code
        )
    else:
        status = "running" + (" (stdin open)" if stdin_open else " (stdin closed)")
        state.item.update(status="completed")
    state.item["output"] = item_text
    lines = [f"process_id: {process_id}", f"status: {status}"]
    if read.capped:
        lines.append("note: more output is waiting; call write_stdin without chars to read it")
    if len(text) > MAX_MODEL_OUTPUT:
        lines.append(f"note: the output of this read was {len(text)} characters; its middle is omitted below")
    lines.append("output:")
    lines.append(clip_for_model(text))
    return "\n".join(lines)


async def _start_process(state: _Call, args: dict[str, Any]) -> str:
    command = _string(args, "command", required=True)
    # Relative to /workspace; the Environment service refuses one outside it.
    cwd = posixpath.normpath(posixpath.join(WORKSPACE, _string(args, "cwd", required=False)))
    yield_ms = _yield_ms(args, DEFAULT_START_YIELD_MS)
    io = state.io
    assert io.env is not None
    state.item.update(command=command, cwd=cwd)
    await io.ensure_environment()
    await state.open()
    process = await io.env.start_process(
        command, name=process_name(io.session_id), cwd=cwd, keepalive=False, stdin=True
    )
    read = await _read(state, process.process_id, 0, yield_ms)
    state.extra = {_CURSOR_KEY: {"id": process.process_id, "next_seq": read.next_seq}}
    return _report(state, process.process_id, read, stdin_open=read.exit is None)


async def _write_stdin(state: _Call, args: dict[str, Any]) -> str:
    process_id = _string(args, "process_id", required=True)
    chars = _string(args, "chars", required=False)
    close = args.get("close_stdin", False)
    if not isinstance(close, bool):
        raise _Refused("'close_stdin' must be a boolean")
    yield_ms = _yield_ms(args, DEFAULT_WRITE_YIELD_MS)
    io = state.io
    assert io.env is not None
    await io.ensure_environment()
    process = await _owned(io, process_id)
    if (chars or close) and not (process.running and process.stdin_open):
        raise _Refused(f"process {process_id} " + ("has exited" if not process.running else "has closed stdin"))
    await state.open()
    stdin_open = process.stdin_open
    if chars or close:
        after = await io.env.write_stdin(process_id, chars.encode(), close=close)
        stdin_open = after.stdin_open
    start = _cursor(await io.transcript(), process_id)
    read = await _read(state, process_id, start, yield_ms)
    state.extra = {_CURSOR_KEY: {"id": process_id, "next_seq": read.next_seq}}
    return _report(state, process_id, read, stdin_open=stdin_open and read.exit is None)


async def _kill_process(state: _Call, args: dict[str, Any]) -> str:
    process_id = _string(args, "process_id", required=True)
    io = state.io
    assert io.env is not None
    await io.ensure_environment()
    await _owned(io, process_id)
    await state.open()
    after = await io.env.kill_process(process_id)
    if after is None or after.exit is None:
        state.item.update(status="completed", output="killed")
        return f"process_id: {process_id}\nstatus: killed"
    state.item.update(status="completed", exit_code=after.exit.exit_code, output=f"exited with code {after.exit.exit_code}")
    return f"process_id: {process_id}\nstatus: exited with code {after.exit.exit_code}"
