"""The coding tools end to end, in real bubblewrap sandboxes through the
public API: ``apply_patch`` and the background-process tools
(``start_process``, ``write_stdin``, ``kill_process``), driven by the
scripted model and read back as ``command_execution`` items through the
strictly parsing SDK."""

from __future__ import annotations

import json
from typing import Any

import openai
from e2e_stack import Stack
from e2e_support import attach_session, environment_of, inline_session, run_script, sandbox_dirs, workspace_file
from openai.types.beta.agent_command_execution_item import AgentCommandExecutionItem
from turns_support import strict_client

SEED_FILES = """write app.py
```
def greet():
    print('hi')


def leave():
    print('bye')
```
write old.txt
```
obsolete
```
write notes.txt
```
keep me
```
"""

EDIT_ADD_DELETE_MOVE = """*** Begin Patch
*** Update File: app.py
@@ def leave():
-    print('bye')
+    print('goodbye')
*** Add File: docs/new.md
+# New
+text
*** Delete File: old.txt
*** Update File: notes.txt
*** Move to: archive/notes.txt
@@
-keep me
+kept
*** End Patch
patched"""

# Reads lines until end of file, answering each; exits 0 at end of file.
ECHO_SERVER = (
    "start ~1500 python3 -u -c \"import sys; print('ready'); "
    "[print('got', line.strip()) for line in sys.stdin]; print('bye')\""
)


async def _commands(client: openai.AsyncOpenAI, session_id: str, turn_id: str) -> list[AgentCommandExecutionItem]:
    items = [i async for i in client.beta.agents.sessions.turns.items.list(turn_id, session_id=session_id, order="asc")]
    return [i for i in items if isinstance(i, AgentCommandExecutionItem)]


def _file(stack: Stack, environment_id: str, path: str) -> Any:
    return workspace_file(stack.data_dir, environment_id, f"/workspace/{path}")


async def test_apply_patch_edits_adds_deletes_and_moves_files(stack: Stack) -> None:
    client = strict_client(stack)
    session = await inline_session(client)
    env_id = environment_of(session)

    turn = await run_script(client, session.id, SEED_FILES + EDIT_ADD_DELETE_MOVE)

    assert turn.status == "completed"
    patch = (await _commands(client, session.id, turn.id))[-1]
    assert patch.command.startswith("apply_patch")
    assert (patch.status, patch.exit_code) == ("completed", 0)
    assert patch.output is not None
    assert patch.output.splitlines()[1:] == ["M app.py", "A docs/new.md", "D old.txt", "D notes.txt", "A archive/notes.txt"]
    assert _file(stack, env_id, "app.py").read_text() == "def greet():\n    print('hi')\n\n\ndef leave():\n    print('goodbye')\n"
    assert _file(stack, env_id, "docs/new.md").read_text() == "# New\ntext\n"
    assert _file(stack, env_id, "archive/notes.txt").read_text() == "kept\n"
    assert not _file(stack, env_id, "old.txt").exists()
    assert not _file(stack, env_id, "notes.txt").exists()


async def test_a_patch_that_does_not_apply_fails_the_call_and_changes_no_file(stack: Stack) -> None:
    client = strict_client(stack)
    session = await inline_session(client)
    env_id = environment_of(session)
    bad = """*** Begin Patch
*** Add File: added.txt
+new
*** Delete File: old.txt
*** Update File: app.py
@@
-    print('not in the file')
+    print('x')
*** End Patch
the model goes on"""

    turn = await run_script(client, session.id, SEED_FILES + bad)

    assert turn.status == "completed"
    patch = (await _commands(client, session.id, turn.id))[-1]
    assert (patch.status, patch.exit_code) == ("failed", None)
    assert not _file(stack, env_id, "added.txt").exists()
    assert _file(stack, env_id, "old.txt").read_text() == "obsolete\n"
    assert "print('hi')" in _file(stack, env_id, "app.py").read_text()


async def test_paths_outside_the_workspace_are_refused_by_the_coding_tools(stack: Stack) -> None:
    client = strict_client(stack)
    session = await inline_session(client)
    env_id = environment_of(session)
    escapes = "\n".join(
        [
            "*** Begin Patch\n*** Add File: ../escaped.txt\n+x\n*** End Patch",
            "*** Begin Patch\n*** Add File: /tmp/escaped.txt\n+x\n*** End Patch",
            "*** Begin Patch\n*** Add File: inside.txt\n+x\n"
            "*** Update File: inside.txt\n*** Move to: ../../moved.txt\n@@\n-x\n+y\n*** End Patch",
            'call start_process {"command": "pwd", "cwd": "/etc"}',
            "done",
        ]
    )

    turn = await run_script(client, session.id, escapes)

    assert turn.status == "completed"
    commands = await _commands(client, session.id, turn.id)
    assert [c.status for c in commands] == ["failed"] * 4
    sandbox = sandbox_dirs(stack.data_dir)[env_id]
    assert not (sandbox / "escaped.txt").exists() and not (sandbox / "moved.txt").exists()
    assert not _file(stack, env_id, "inside.txt").exists()


async def test_a_long_running_process_is_polled_and_fed_stdin_across_turns(stack: Stack) -> None:
    client = strict_client(stack)
    session = await inline_session(client)

    started = await run_script(client, session.id, ECHO_SERVER)
    fed = await run_script(client, session.id, "poll ~0\nstdin hello\nstdin ~0 world\neof ~20000\ndone")

    assert (started.status, fed.status) == ("completed", "completed")
    (start,) = await _commands(client, session.id, started.id)
    # It waits for stdin, so it is still running when the call yields.
    assert (start.status, start.exit_code) == ("completed", None)
    calls = await _commands(client, session.id, fed.id)
    assert [c.exit_code for c in calls] == [None, None, None, 0]
    assert all(c.command.startswith("write_stdin proc_") for c in calls)
    # Each read continues where the previous one ended: together they are the whole output, once.
    together = "".join(c.output or "" for c in [start, *calls])
    assert together == "ready\ngot hello\ngot world\nbye\n"


async def test_a_process_is_addressable_only_by_the_session_that_started_it(stack: Stack) -> None:
    client = strict_client(stack)
    owner = await inline_session(client)
    # A background process's BERTH_PROCESS_ID is its process_id.
    await run_script(client, owner.id, "start ~0 sh -c 'echo $BERTH_PROCESS_ID; exec sleep 600'")
    printed = ""
    for _ in range(20):
        polled = await run_script(client, owner.id, "poll ~1000")
        printed += "".join(c.output or "" for c in await _commands(client, owner.id, polled.id))
        if printed.endswith("\n"):
            break
    process_id = printed.strip()
    assert process_id.startswith("proc_")
    other = await attach_session(client, environment_of(owner))

    tried = await run_script(
        client,
        other.id,
        f"call write_stdin {json.dumps({'process_id': process_id, 'chars': 'x'})}\n"
        f"call kill_process {json.dumps({'process_id': process_id})}\ndone",
    )
    killed = await run_script(client, owner.id, "kill\ndone")

    assert [c.status for c in await _commands(client, other.id, tried.id)] == ["failed", "failed"]
    (kill,) = await _commands(client, owner.id, killed.id)
    assert (kill.status, kill.exit_code) == ("completed", -9)


async def test_reading_or_writing_a_directory_as_a_file_fails_the_call_and_the_turn_goes_on(stack: Stack) -> None:
    client = strict_client(stack)
    session = await inline_session(client)
    script = "$ mkdir -p adir\nread adir\nwrite adir\n```\nx\n```\n$ echo still here"

    turn = await run_script(client, session.id, script)

    assert turn.status == "completed"
    commands = await _commands(client, session.id, turn.id)
    assert [c.status for c in commands] == ["completed", "failed", "failed", "completed"]
