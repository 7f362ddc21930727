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
``automation {JSON}``
    Call the ``automations`` tool (offered when the agent's tools include
    ``{"type": "automations"}``) with the JSON object as its arguments, e.g.
    ``automation {"instructions": "check the build", "delay_seconds": 60}``
    or ``automation {"instructions": "daily report", "expression": "0 9 * * *",
    "timezone": "Europe/Paris"}``: the instructions come back to this
    session as a user message at that time.
``*** Begin Patch`` … ``*** End Patch``
    The lines from ``*** Begin Patch`` through ``*** End Patch`` are one
    ``apply_patch`` call with that patch (the Codex format, see
    ``harness/patch.py``).
``start [~MS] COMMAND``
    Start COMMAND in the background with the ``start_process`` tool,
    waiting up to MS milliseconds (``yield_time_ms``) for its output.
``stdin [~MS] TEXT``
    Write TEXT and a newline to the stdin of the last process a ``start``
    of this session started (``write_stdin``), then read its output for up
    to MS milliseconds.
``poll [~MS]``
    Read more output of that process (``write_stdin`` without chars).
``eof [~MS]``
    Close that process's stdin, then read its output.
``kill``
    Kill that process (``kill_process``).
``subagent NAME[/MODEL]: TASK``
    Create a subagent nicknamed NAME (one word) with TASK as its first
    message (``create_subagent``), on MODEL when one is given; ``\\n`` in
    TASK stands for a line break, so a scripted subagent can run a script of
    several lines.
``subagent send NAME: TEXT``
    Send TEXT to subagent NAME (``send_subagent_input``).
``subagent wait [NAME ...]``
    Wait for the named subagents, or for every subagent this session
    created when none is named (``wait_for_subagents``).
``subagent interrupt NAME`` / ``subagent resume NAME`` / ``subagent close NAME``
    Interrupt, resume or close subagent NAME.
``& ACTION``
    Any action line prefixed with ``& `` is issued in the same model response
    as the action before it (parallel tool calls).
any other line
    Echoed: all such lines, joined by newlines and stripped, form the final
    assistant message. A script made only of actions ends with ``done``.

"The last process" is resolved when the call is issued: the
``process_id`` in the output of the latest ``start_process`` call in the
session's transcript, in this turn or an earlier one. A subagent NAME is
resolved the same way, to the ``subagent_id`` the latest ``create_subagent``
call with that name reported.

Actions run one step per model call, in order (a step is an action plus the
``&`` actions after it): the model counts the tool calls it already made
after the last user message and issues the next step; once all ran it
answers with the final message. Usage is estimated as one token per
four characters.
"""

from __future__ import annotations

import json
import re
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


# Stands for the process_id of the last process started, until a call is issued.
LAST_PROCESS = "@last"
_PROCESS_ID = re.compile(r"^process_id: (\S+)$", re.MULTILINE)
# Stands for the ID of the subagent of a name (``@subagent:NAME``), or of
# every subagent created (``@subagents``), until a call is issued.
_SUBAGENT = "@subagent:"
_ALL_SUBAGENTS = "@subagents"
_SUBAGENT_ID = re.compile(r"^subagent_id: (\S+)$", re.MULTILINE)
_SUBAGENT_VERBS = {
    "send": "send_subagent_input",
    "wait": "wait_for_subagents",
    "interrupt": "interrupt_subagent",
    "resume": "resume_subagent",
    "close": "close_subagent",
}


def _subagent_action(rest: str) -> ScriptAction | None:
    """The action of a ``subagent ...`` line, or None when it is not one."""
    verb, _, tail = rest.partition(" ")
    tail = tail.strip()
    if verb == "wait":
        names = tail.split()
        ids: Any = [_SUBAGENT + n for n in names] if names else _ALL_SUBAGENTS
        return ScriptAction("wait_for_subagents", {"subagent_ids": ids})
    if verb == "send":
        name, sep, text = tail.partition(":")
        if not sep or not name.strip():
            return None
        return ScriptAction("send_subagent_input", {"subagent_id": _SUBAGENT + name.strip(), "message": text.strip().replace("\\n", "\n")})
    if verb in _SUBAGENT_VERBS:
        return ScriptAction(_SUBAGENT_VERBS[verb], {"subagent_id": _SUBAGENT + tail}) if tail else None
    name, sep, task = rest.partition(":")
    if not sep or not name.strip() or " " in name.strip():
        return None
    name, _, model = name.strip().partition("/")
    arguments = {"name": name, "task": task.strip().replace("\\n", "\n")}
    return ScriptAction("create_subagent", {**arguments, "model": model} if model else arguments)


def _yield_option(rest: str) -> tuple[dict[str, Any], str]:
    """A leading ``~MS`` as ``yield_time_ms``, and the rest of the line."""
    if rest.startswith("~"):
        option, _, rest = rest.partition(" ")
        if option[1:].isdigit():
            return {"yield_time_ms": int(option[1:])}, rest.strip()
    return {}, rest


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
        elif stripped.startswith("automation "):
            actions.append(ScriptAction("automations", _json_object(stripped[len("automation ") :])))
        elif stripped.startswith("call "):
            name, _, rest = stripped[len("call ") :].strip().partition(" ")
            actions.append(ScriptAction(name, _json_object(rest)))
        elif stripped == "*** Begin Patch":
            body = [stripped]
            i += 1
            while i < len(lines) and lines[i].strip() != "*** End Patch":
                body.append(lines[i])
                i += 1
            body.append("*** End Patch")
            actions.append(ScriptAction("apply_patch", {"input": "\n".join(body) + "\n"}))
        elif stripped.startswith("start "):
            options, command = _yield_option(stripped[len("start ") :].strip())
            actions.append(ScriptAction("start_process", {"command": command, **options}))
        elif stripped.split(" ", 1)[0] in ("stdin", "poll", "eof"):
            word, _, rest = stripped.partition(" ")
            options, text = _yield_option(rest.strip())
            arguments: dict[str, Any] = {"process_id": LAST_PROCESS, **options}
            if word == "stdin":
                arguments["chars"] = text + "\n"
            elif word == "eof":
                arguments["close_stdin"] = True
            actions.append(ScriptAction("write_stdin", arguments))
        elif stripped == "kill":
            actions.append(ScriptAction("kill_process", {"process_id": LAST_PROCESS}))
        elif stripped.startswith("subagent ") and (subagent := _subagent_action(stripped[len("subagent ") :].strip())):
            actions.append(subagent)
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
                        arguments=json.dumps(_resolve(action.arguments, request.transcript), separators=(",", ":")),
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


def _subagent_ids(transcript: list[Entry]) -> dict[str, str]:
    """The subagent IDs the session's create_subagent calls reported, by
    name, in creation order (a later one of a name replaces the earlier)."""
    names: dict[str, str] = {}
    for e in transcript:
        for c in e.get("tool_calls") or ():
            if c.get("name") == "create_subagent":
                names[str(c.get("id"))] = str(_json_object(str(c.get("arguments") or "")).get("name") or "")
    out: dict[str, str] = {}
    for entry in transcript:
        if entry.get("role") == "tool" and entry.get("call_id") in names:
            found = _SUBAGENT_ID.search(str(entry.get("output") or ""))
            if found:
                out[names[str(entry["call_id"])]] = found.group(1)
    return out


def _resolve_subagents(arguments: dict[str, Any], transcript: list[Entry]) -> dict[str, Any]:
    ids = _subagent_ids(transcript)

    def one(value: str) -> str:
        return ids.get(value[len(_SUBAGENT) :], value) if value.startswith(_SUBAGENT) else value

    out = dict(arguments)
    if "subagent_id" in out:
        out["subagent_id"] = one(str(out["subagent_id"]))
    if out.get("subagent_ids") == _ALL_SUBAGENTS:
        out["subagent_ids"] = list(ids.values())
    elif isinstance(out.get("subagent_ids"), list):
        out["subagent_ids"] = [one(str(v)) for v in out["subagent_ids"]]
    return out


def _resolve(arguments: dict[str, Any], transcript: list[Entry]) -> dict[str, Any]:
    """``arguments`` with LAST_PROCESS replaced by the process_id the latest
    start_process call reported (left as is when there is none), and
    subagent names by their IDs."""
    if "subagent_id" in arguments or "subagent_ids" in arguments:
        return _resolve_subagents(arguments, transcript)
    if arguments.get("process_id") != LAST_PROCESS:
        return arguments
    started = {
        c.get("id")
        for e in transcript
        for c in e.get("tool_calls") or ()
        if c.get("name") == "start_process"
    }
    for entry in reversed(transcript):
        if entry.get("role") == "tool" and entry.get("call_id") in started:
            found = _PROCESS_ID.search(str(entry.get("output") or ""))
            if found:
                return {**arguments, "process_id": found.group(1)}
    return arguments
