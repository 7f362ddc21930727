"""The ``scripted`` model: a deterministic, offline stand-in for a real model.

It is the default when no ``BERTH_MODEL_BASE_URL`` is configured, and it runs
through exactly the same loop as a real model, so items and events have the
same shapes. The script is the text of the **last user message**, read line by
line:

``$ COMMAND``
    Run COMMAND with the ``exec_command`` tool (``sh -c`` in /workspace).
``write PATH`` followed by a fenced block (a line starting with three
backticks, the content, and a closing line of three backticks)
    Write the block's content (with a trailing newline) to PATH with the
    ``write_file`` tool.
``read PATH``
    Read PATH with the ``read_file`` tool.
``call NAME {JSON}``
    Call the application function tool NAME with the JSON object as its
    arguments (``{}`` when omitted). The turn waits for the tool result.
``mcp LABEL.TOOL {JSON}``
    Call TOOL of the MCP server LABEL (tool name ``LABEL.TOOL``) with the
    JSON object as its arguments.
``& ACTION``
    Any action line prefixed with ``& `` is issued in the same model response
    as the action before it (parallel tool calls).
any other line
    Echoed: all such lines, joined by newlines and stripped, form the final
    assistant message. A script made only of actions ends with ``done``.

Actions run one step per model call, in order (a step is an action plus the
``&`` actions after it): the model counts the tool calls it already made
after the last user message and issues the next step; once all ran it
answers with the final message. Usage is estimated as one token per
four characters.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from services.session.harness.models.base import (
    Completed,
    Entry,
    ModelRequest,
    ModelResponse,
    StreamEvent,
    TextDelta,
    ToolCall,
    Usage,
)

__all__ = ["ScriptedProvider", "parse_script", "ScriptAction", "mcp_tool_name"]


@dataclass(frozen=True)
class ScriptAction:
    tool: str
    arguments: dict[str, Any]
    # Issued in the same model response as the action before it.
    parallel: bool = False


def mcp_tool_name(label: str, tool: str) -> str:
    return f"{label}.{tool}"


def _json_object(text: str) -> dict[str, Any]:
    text = text.strip()
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return {"input": text}
    return value if isinstance(value, dict) else {"input": value}


def parse_script(script: str) -> tuple[list[ScriptAction], str]:
    """Returns the actions in order and the echoed text."""
    actions: list[ScriptAction] = []
    echoed: list[str] = []
    lines = script.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        parallel = bool(actions) and stripped.startswith("& ")
        if parallel:
            stripped = stripped[2:].strip()
        before = len(actions)
        if stripped.startswith("$ ") or stripped == "$":
            actions.append(ScriptAction("exec_command", {"command": stripped[1:].strip()}))
        elif stripped.startswith("write ") and i + 1 < len(lines) and lines[i + 1].strip().startswith("```"):
            path = stripped[len("write ") :].strip()
            body: list[str] = []
            i += 2
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            content = "\n".join(body) + ("\n" if body else "")
            actions.append(ScriptAction("write_file", {"path": path, "content": content}))
        elif stripped.startswith("read "):
            actions.append(ScriptAction("read_file", {"path": stripped[len("read ") :].strip()}))
        elif stripped.startswith("call "):
            name, _, rest = stripped[len("call ") :].strip().partition(" ")
            actions.append(ScriptAction(name, _json_object(rest)))
        elif stripped.startswith("mcp "):
            target, _, rest = stripped[len("mcp ") :].strip().partition(" ")
            label, _, tool = target.partition(".")
            actions.append(ScriptAction(mcp_tool_name(label, tool), _json_object(rest)))
        else:
            echoed.append(line)
        if parallel and len(actions) > before:
            actions[-1] = ScriptAction(actions[-1].tool, actions[-1].arguments, parallel=True)
        i += 1
    return actions, "\n".join(echoed).strip()


def _steps(actions: list[ScriptAction]) -> list[list[ScriptAction]]:
    steps: list[list[ScriptAction]] = []
    for action in actions:
        if action.parallel and steps:
            steps[-1].append(action)
        else:
            steps.append([action])
    return steps


def _tokens(text: str) -> int:
    return max(1, len(text) // 4) if text else 0


class ScriptedProvider:
    async def stream(self, request: ModelRequest) -> AsyncIterator[StreamEvent]:
        response = await self.complete(request)
        if response.text:
            yield TextDelta(response.text)
        yield Completed(response)

    async def complete(self, request: ModelRequest) -> ModelResponse:
        last_user = -1
        for index, entry in enumerate(request.transcript):
            if entry.get("role") == "user":
                last_user = index
        script = str(request.transcript[last_user].get("text", "")) if last_user >= 0 else ""
        made = sum(len(e.get("tool_calls") or ()) for e in request.transcript[last_user + 1 :])
        actions, text = parse_script(script)
        input_tokens = sum(_tokens(_entry_text(e)) for e in request.transcript)
        issued = 0
        for step in _steps(actions):
            if issued >= made:
                calls = [
                    ToolCall(
                        id=f"call_script_{issued + n}",
                        name=action.tool,
                        arguments=json.dumps(action.arguments, separators=(",", ":")),
                    )
                    for n, action in enumerate(step)
                ]
                output = sum(_tokens(c.arguments) for c in calls)
                return ModelResponse(text=None, tool_calls=calls, usage=Usage(input_tokens, output))
            issued += len(step)
        answer = text or "done"
        return ModelResponse(text=answer, usage=Usage(input_tokens, _tokens(answer)))


def _entry_text(entry: Entry) -> str:
    parts = [str(entry.get("text") or ""), str(entry.get("output") or "")]
    parts.extend(str(c.get("arguments", "")) for c in entry.get("tool_calls") or ())
    return "".join(parts)
