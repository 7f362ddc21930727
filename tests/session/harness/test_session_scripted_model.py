"""The scripted model and the transcript rules, without any service."""

from __future__ import annotations

import json
from typing import Any

from services.session.harness.models.base import ModelRequest, normalize_transcript
from services.session.harness.models.scripted import ScriptedProvider, parse_script

SCRIPT = """Plan:
$ echo hi
write notes/a.md
```
# Title
body
```
read notes/a.md
call lookup {"q": "x"}
mcp docs.search {"query": "y"}
That is all."""


def test_a_script_is_split_into_ordered_actions_and_echoed_text() -> None:
    actions, text = parse_script(SCRIPT)
    assert [(a.tool, a.arguments) for a in actions] == [
        ("exec_command", {"command": "echo hi"}),
        ("write_file", {"path": "notes/a.md", "content": "# Title\nbody\n"}),
        ("read_file", {"path": "notes/a.md"}),
        ("lookup", {"q": "x"}),
        ("docs.search", {"query": "y"}),
    ]
    assert text == "Plan:\nThat is all."


async def test_the_scripted_model_issues_one_tool_call_per_step_then_answers() -> None:
    model = ScriptedProvider()
    transcript: list[dict[str, Any]] = [{"role": "user", "text": "old"}, {"role": "assistant", "text": "old"}, {"role": "user", "text": "$ ls\ncall f"}]
    request = ModelRequest(model="scripted", instructions=None, transcript=transcript, tools=[])
    first = await model.complete(request)
    assert first.text is None and [(c.name, json.loads(c.arguments)) for c in first.tool_calls] == [("exec_command", {"command": "ls"})]
    transcript += [{"role": "assistant", "tool_calls": [first.tool_calls[0].as_entry()]}, {"role": "tool", "call_id": first.tool_calls[0].id, "output": "x"}]
    second = await model.complete(request)
    assert [c.name for c in second.tool_calls] == ["f"]
    transcript += [{"role": "assistant", "tool_calls": [second.tool_calls[0].as_entry()]}]
    final = await model.complete(request)
    assert final.text == "done" and final.tool_calls == [] and final.usage is not None


def test_tool_results_follow_their_calls_and_missing_ones_are_filled_in() -> None:
    entries: list[dict[str, Any]] = [
        {"role": "user", "text": "u"},
        {"role": "assistant", "tool_calls": [{"id": "a", "name": "f", "arguments": "{}"}]},
        {"role": "assistant", "tool_calls": [{"id": "b", "name": "g", "arguments": "{}"}]},
        {"role": "tool", "call_id": "b", "output": "B"},
        {"role": "tool", "call_id": "a", "output": "A"},
        {"role": "assistant", "tool_calls": [{"id": "c", "name": "h", "arguments": "{}"}]},
    ]
    out = normalize_transcript(entries)
    assert [(e["role"], e.get("call_id")) for e in out] == [
        ("user", None),
        ("assistant", None),
        ("tool", "a"),
        ("assistant", None),
        ("tool", "b"),
        ("assistant", None),
        ("tool", "c"),
    ]
    assert out[-1]["output"].startswith("error:")


async def test_actions_prefixed_with_an_ampersand_are_issued_in_one_model_response() -> None:
    script = 'mcp docs.a {"n": 1}\n& mcp docs.b {"n": 2}\n& mcp docs.c\n$ ls\nok'
    actions, text = parse_script(script)
    assert [(a.tool, a.parallel) for a in actions] == [("docs.a", False), ("docs.b", True), ("docs.c", True), ("exec_command", False)]
    assert text == "ok"
    model = ScriptedProvider()
    transcript: list[dict[str, object]] = [{"role": "user", "text": script}]
    request = ModelRequest(model="scripted", instructions=None, transcript=transcript, tools=[])  # type: ignore[arg-type]
    first = await model.complete(request)
    assert [(c.name, json.loads(c.arguments)) for c in first.tool_calls] == [("docs.a", {"n": 1}), ("docs.b", {"n": 2}), ("docs.c", {})]
    assert len({c.id for c in first.tool_calls}) == 3
    for call in first.tool_calls:
        transcript += [{"role": "assistant", "tool_calls": [call.as_entry()]}, {"role": "tool", "call_id": call.id, "output": "x"}]
    second = await model.complete(request)
    assert [c.name for c in second.tool_calls] == ["exec_command"]
    transcript += [{"role": "assistant", "tool_calls": [second.tool_calls[0].as_entry()]}]
    assert (await model.complete(request)).text == "ok"


def test_a_script_has_syntax_for_patches_and_background_processes() -> None:
    script = (
        "*** Begin Patch\n*** Add File: a.txt\n+x\n*** End Patch\n"
        "start ~500 python3 server.py\n"
        "stdin hello\n"
        "poll ~2000\n"
        "eof\n"
        "kill\n"
        "ok"
    )
    actions, text = parse_script(script)
    assert [(a.tool, a.arguments) for a in actions] == [
        ("apply_patch", {"input": "*** Begin Patch\n*** Add File: a.txt\n+x\n*** End Patch\n"}),
        ("start_process", {"command": "python3 server.py", "yield_time_ms": 500}),
        ("write_stdin", {"process_id": "@last", "chars": "hello\n"}),
        ("write_stdin", {"process_id": "@last", "yield_time_ms": 2000}),
        ("write_stdin", {"process_id": "@last", "close_stdin": True}),
        ("kill_process", {"process_id": "@last"}),
    ]
    assert text == "ok"


async def test_the_last_process_is_the_one_the_latest_start_reported() -> None:
    model = ScriptedProvider()
    transcript: list[dict[str, Any]] = [
        {"role": "user", "text": "start a"},
        {"role": "assistant", "tool_calls": [{"id": "s1", "name": "start_process", "arguments": "{}"}]},
        {"role": "tool", "call_id": "s1", "output": "process_id: proc_old\nstatus: running"},
        {"role": "assistant", "tool_calls": [{"id": "s2", "name": "start_process", "arguments": "{}"}]},
        {"role": "tool", "call_id": "s2", "output": "process_id: proc_new\nstatus: running"},
        {"role": "assistant", "text": "started"},
        {"role": "user", "text": "stdin hi"},
    ]
    request = ModelRequest(model="scripted", instructions=None, transcript=transcript, tools=[])
    (call,) = (await model.complete(request)).tool_calls
    assert (call.name, json.loads(call.arguments)) == ("write_stdin", {"process_id": "proc_new", "chars": "hi\n"})


def test_subagent_lines_are_calls_of_the_subagent_tools_and_other_subagent_text_is_echoed() -> None:
    script = (
        "subagent a: $ echo one\\n$ echo two\n"
        "subagent send a: more\n"
        "subagent wait\n"
        "subagent wait a b\n"
        "subagent interrupt a\nsubagent resume a\nsubagent close a\n"
        "subagent agents are helpers"
    )
    actions, text = parse_script(script)
    assert [(a.tool, a.arguments) for a in actions] == [
        ("create_subagent", {"name": "a", "task": "$ echo one\n$ echo two"}),
        ("send_subagent_input", {"subagent_id": "@subagent:a", "message": "more"}),
        ("wait_for_subagents", {"subagent_ids": "@subagents"}),
        ("wait_for_subagents", {"subagent_ids": ["@subagent:a", "@subagent:b"]}),
        ("interrupt_subagent", {"subagent_id": "@subagent:a"}),
        ("resume_subagent", {"subagent_id": "@subagent:a"}),
        ("close_subagent", {"subagent_id": "@subagent:a"}),
    ]
    assert text == "subagent agents are helpers"


async def test_subagent_names_resolve_to_the_ids_their_creations_reported() -> None:
    create = {"id": "c1", "name": "create_subagent", "arguments": json.dumps({"name": "a", "task": "x"})}
    transcript: list[dict[str, Any]] = [
        {"role": "user", "text": "subagent a: x\nsubagent send a: hi\nsubagent wait"},
        {"role": "assistant", "tool_calls": [create]},
        {"role": "tool", "call_id": "c1", "output": "subagent_id: subagent_1"},
    ]
    model = ScriptedProvider()
    send = await model.complete(ModelRequest(model="scripted", instructions=None, transcript=transcript, tools=[]))
    assert [json.loads(c.arguments) for c in send.tool_calls] == [{"subagent_id": "subagent_1", "message": "hi"}]
    transcript += [
        {"role": "assistant", "tool_calls": [{"id": "c2", "name": "send_subagent_input", "arguments": "{}"}]},
        {"role": "tool", "call_id": "c2", "output": "sent"},
    ]
    wait = await model.complete(ModelRequest(model="scripted", instructions=None, transcript=transcript, tools=[]))
    assert [json.loads(c.arguments) for c in wait.tool_calls] == [{"subagent_ids": ["subagent_1"]}]
