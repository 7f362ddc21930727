"""Tools the harness offers the model and how each call executes.

- Environment tools (only with an environment): ``exec_command``,
  ``read_file``, ``write_file``, and the coding tools ``apply_patch``,
  ``start_process``, ``write_stdin`` and ``kill_process``
  (``harness/coding_tools.py``). They run through the Environment service, so
  the first one of a turn enters the init guard.
- Application function tools (``agent.tools`` of type ``function``): the call
  becomes a pending function call; the turn waits for the tool result.
- MCP tools (``LABEL.TOOL``): see ``harness/mcp_tools.py``.
- Subagent tools (with ``multi_agent`` enabled): see ``harness/subagents.py``.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import posixpath
import time
from dataclasses import dataclass
from collections.abc import AsyncGenerator
from typing import Any

from services.core.errors import BerthError
from services.session.agents import SUBAGENT_TOOL_NAMES, AgentConfig, function_tools
from services.session.harness.automation_tool import AUTOMATIONS_TOOL, automations_enabled, run_automations_tool
from services.session.harness.coding_tools import CODING_TOOL_NAMES, CODING_TOOLS, run_coding_tool
from services.session.harness.environment import CommandEvent, CommandExit, CommandOutput, environment_unusable, model_fault
from services.session.harness.io import ItemHandle, TurnFailure, TurnIO
from services.session.harness.models.base import ToolCall, ToolSpec
from services.session.harness.subagents import SUBAGENT_TOOLS, run_subagent_tool
from services.session.harness.tool_output import MAX_ITEM_OUTPUT, MAX_MODEL_OUTPUT
from services.session.harness.tool_output import call_entries as _call_entries
from services.session.harness.tool_output import clip_for_model as _clip_for_model

__all__ = [
    "tool_specs",
    "execute_tool_call",
    "resume_command",
    "PendingCall",
    "WORKSPACE",
    "MAX_MODEL_OUTPUT",
    "INTERRUPTED",
]

WORKSPACE = "/workspace"
MAX_READ_BYTES = 1024 * 1024
DEFAULT_EXEC_TIMEOUT_MS = 10 * 60 * 1000

_ENV_TOOLS = [
    ToolSpec(
        name="exec_command",
        description=(
            "Run a shell command (sh -c) in the environment and return its exit code and combined output. "
            "Write deliverables to $REBYTE_OUTPUT_DIR; they are published as artifacts when the turn completes."
        ),
        parameters={
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": "The shell command."},
                "cwd": {"type": "string", "description": "Working directory; default /workspace."},
                "timeout_ms": {"type": "integer", "description": "Timeout in milliseconds; default 600000."},
            },
            "required": ["command"],
        },
    ),
    ToolSpec(
        name="read_file",
        description="Read a UTF-8 text file from the environment (paths are relative to /workspace).",
        parameters={
            "type": "object",
            "properties": {"path": {"type": "string", "description": "File path."}},
            "required": ["path"],
        },
    ),
    ToolSpec(
        name="write_file",
        description="Create or replace a file in the environment with the given text (paths are relative to /workspace).",
        parameters={
            "type": "object",
            "properties": {
                "path": {"type": "string", "description": "File path."},
                "content": {"type": "string", "description": "The complete new content."},
            },
            "required": ["path", "content"],
        },
    ),
]
_ENV_TOOL_NAMES = {t.name for t in _ENV_TOOLS}


def tool_specs(config: AgentConfig, *, has_environment: bool) -> list[ToolSpec]:
    specs = [*_ENV_TOOLS, *CODING_TOOLS] if has_environment else []
    if _multi_agent(config):
        specs.extend(SUBAGENT_TOOLS)
    for tool in function_tools(config):
        specs.append(ToolSpec(tool["name"], tool.get("description") or "", tool.get("parameters") or {"type": "object"}))
    if automations_enabled(config):
        specs.append(AUTOMATIONS_TOOL)
    return specs


def _multi_agent(config: AgentConfig) -> bool:
    return bool((config.get("multi_agent") or {}).get("enabled"))


@dataclass(frozen=True)
class PendingCall:
    call_id: str


def _arguments(call: ToolCall) -> dict[str, Any] | None:
    try:
        value = json.loads(call.arguments or "{}")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _workspace_path(path: str) -> str:
    return posixpath.normpath(path if path.startswith("/") else posixpath.join(WORKSPACE, path))


async def execute_tool_call(io: TurnIO, config: AgentConfig, call: ToolCall) -> PendingCall | None:
    """Runs one tool call to completion, or registers it as a pending
    application function call and returns it."""
    functions = {t["name"] for t in function_tools(config)}
    if call.name in _ENV_TOOL_NAMES:
        await _environment_tool(io, call)
        return None
    if call.name in CODING_TOOL_NAMES:
        await run_coding_tool(io, call)
        return None
    if call.name in SUBAGENT_TOOL_NAMES and _multi_agent(config):
        await run_subagent_tool(io, io.subagents, call)
        return None
    if call.name in functions:
        return PendingCall(await io.add_function_call(call.name, call.arguments, call.id))
    if call.name == AUTOMATIONS_TOOL.name and automations_enabled(config):
        await run_automations_tool(io, call)
        return None
    # The model called a tool it was not given; tell it so without a public item.
    await io.add_item(
        {"type": "function_call", "call_id": call.id, "name": call.name, "arguments": call.arguments, "status": "failed"},
        entries=_call_entries(call, f"error: there is no tool named {call.name!r}"),
        output=False,
        done=False,
        visible=False,
    )
    return None


async def _environment_tool(io: TurnIO, call: ToolCall) -> None:
    args = _arguments(call)
    if call.name == "exec_command":
        command = str(args.get("command", "")) if args else ""
        cwd = str(args.get("cwd") or WORKSPACE) if args else WORKSPACE
        item: dict[str, Any] = {
            "type": "command_execution",
            "command": command or call.arguments,
            "cwd": cwd,
            "status": "in_progress",
            "exit_code": None,
            "output": None,
            "duration_ms": None,
        }
    else:
        path = str(args.get("path", "")) if args else ""
        item = {
            "type": "command_execution",
            "command": f"{call.name} {path}".strip(),
            "cwd": WORKSPACE,
            "status": "in_progress",
            "exit_code": None,
            "output": None,
            "duration_ms": None,
        }
    if io.environment_id is None or io.env is None:
        message = "error: this session has no environment; environment tools are unavailable"
        await io.add_item(
            {**item, "status": "failed", "output": message}, entries=_call_entries(call, message), output=True, done=True
        )
        return
    if args is None or (call.name == "exec_command" and not args.get("command")) or (
        call.name != "exec_command" and not args.get("path")
    ):
        message = f"error: invalid arguments for {call.name}: {call.arguments}"
        await io.add_item(
            {**item, "status": "failed", "output": message}, entries=_call_entries(call, message), output=True, done=True
        )
        return

    await io.ensure_environment()
    # The call is the open item's entry, so a worker that resumes the turn
    # after this one died can answer it as interrupted.
    handle = await io.add_item(item, entries=_call_entries(call, "")[:1], output=True, done=False)
    io.track_item(handle, item)
    started = time.monotonic()
    if call.name == "exec_command":
        item, model_output = await _exec(io, handle, item, args)
    elif call.name == "read_file":
        item, model_output = await _read(io, item, args)
    else:
        item, model_output = await _write(io, item, args)
    item["duration_ms"] = item["duration_ms"] if item["duration_ms"] is not None else int((time.monotonic() - started) * 1000)
    await io.finish_item(handle, item, entries=_call_entries(call, model_output))


async def _exec(io: TurnIO, handle: Any, item: dict[str, Any], args: dict[str, Any]) -> tuple[dict[str, Any], str]:
    assert io.env is not None
    timeout_ms = args.get("timeout_ms")
    # Keyed by its item, so a worker that resumes the turn reattaches to it.
    events = io.env.exec(
        str(args["command"]),
        cwd=str(args.get("cwd") or ""),
        timeout_ms=int(timeout_ms) if isinstance(timeout_ms, int) and timeout_ms > 0 else DEFAULT_EXEC_TIMEOUT_MS,
        key=handle.id,
    )
    return await _command_result(io, handle, item, events)


async def _command_result(
    io: TurnIO, handle: Any, item: dict[str, Any], events: AsyncGenerator[CommandEvent, None], *, shown: int = 0
) -> tuple[dict[str, Any], str]:
    """Follows a command's events to its exit: output deltas (beyond the
    first ``shown`` characters, already sent), then the finished item and
    what the model is told."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    output: list[str] = []
    size = 0
    exit_code: int | None = None
    timed_out = False
    duration_ms: int | None = None
    failure: BerthError | None = None
    # Closed on cancellation too, which kills the command's process tree.
    async with contextlib.aclosing(events):
        while True:
            try:
                event = await anext(events)
            except StopAsyncIteration:
                break
            except BerthError as exc:
                failure = exc
                break
            if isinstance(event, CommandOutput):
                text = decoder.decode(event.data)
                if not text:
                    continue
                start = size
                if size < MAX_ITEM_OUTPUT:
                    output.append(text)
                size += len(text)
                item["output"] = "".join(output)
                io.track_item(handle, item)
                if size <= shown:
                    continue
                await io.emit(
                    {
                        "type": "agent.output.command_execution_output.delta",
                        "item_id": handle.id,
                        "output_index": handle.output_index,
                        "delta": text[max(0, shown - start) :],
                    }
                )
            elif isinstance(event, CommandExit):
                exit_code = event.exit_code
                timed_out = event.timed_out
                duration_ms = event.duration_ms
    if failure is not None:
        if environment_unusable(failure):
            item.update(status="failed", output="".join(output) or None)
            io.track_item(handle, item)
            raise io.sandbox_failure(failure) from failure
        text = f"error: {failure.message}"
        item.update(status="failed", output=text)
        return item, text
    tail = decoder.decode(b"", final=True)
    if tail:
        output.append(tail)
    text = "".join(output)
    if size > MAX_ITEM_OUTPUT:
        text += f"\n...[output truncated, {size} characters in total]"
    item.update(
        status="completed" if exit_code == 0 else "failed",
        exit_code=exit_code,
        output=text,
        duration_ms=duration_ms,
    )
    note = " (timed out)" if timed_out else ""
    return item, f"exit_code: {exit_code}{note}\n{_clip_for_model(text)}"


INTERRUPTED = "error: the call was interrupted (the process running this turn stopped) and did not finish"


async def resume_command(io: TurnIO, handle: ItemHandle, item: dict[str, Any], call: ToolCall, shown: str) -> None:
    """Finishes an ``exec_command`` item that a worker which died left open.
    A command that ran on in the sandbox is reattached to and followed to its
    exit, with the output deltas beyond ``shown`` (what the dead worker had
    sent); one that was never started (the worker died before, or while, it
    waited for an unavailable service) is started now. A command whose
    output cannot be followed is reported to the model as interrupted."""
    io.track_item(handle, item)
    args = _arguments(call) or {}
    model_output = ""
    if io.env is not None:
        events = await io.env.reattach(handle.id)
        if events is None and args.get("command"):
            item, model_output = await _exec(io, handle, item, args)
        elif events is not None:
            item, model_output = await _command_result(io, handle, item, events, shown=len(shown))
    if not model_output or (item.get("status") == "failed" and item.get("exit_code") is None):
        item.update(status="incomplete", output=shown or None)
        model_output = INTERRUPTED + (f"; its output so far:\n{shown}" if shown else "")
    await io.finish_item(handle, item, entries=_call_entries(call, model_output))


async def _read(io: TurnIO, item: dict[str, Any], args: dict[str, Any]) -> tuple[dict[str, Any], str]:
    assert io.env is not None
    path = _workspace_path(str(args["path"]))
    try:
        data, truncated = await io.env.read_file(path, limit=MAX_READ_BYTES)
    except BerthError as exc:
        if not model_fault(exc):
            raise io.sandbox_failure(exc) from exc
        message = f"error: {exc.message}"
        item.update(status="failed", exit_code=1, output=message)
        return item, message
    text = data.decode("utf-8", errors="replace")
    if truncated:
        text += "\n...[file truncated]"
    item.update(status="completed", exit_code=0, output=text if len(text) <= MAX_ITEM_OUTPUT else text[:MAX_ITEM_OUTPUT])
    return item, _clip_for_model(text)


async def _write(io: TurnIO, item: dict[str, Any], args: dict[str, Any]) -> tuple[dict[str, Any], str]:
    assert io.env is not None
    path = _workspace_path(str(args["path"]))
    content = args.get("content", "")
    data = content.encode() if isinstance(content, str) else json.dumps(content).encode()
    try:
        await io.env.write_file(path, data)
    except BerthError as exc:
        if not model_fault(exc):
            raise io.sandbox_failure(exc) from exc
        message = f"error: {exc.message}"
        item.update(status="failed", exit_code=1, output=message)
        return item, message
    message = f"wrote {len(data)} bytes to {path}"
    item.update(status="completed", exit_code=0, output=message)
    return item, message


__all__ += ["TurnFailure"]
