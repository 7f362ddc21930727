"""The apply_patch format: parsing and matching hunks, without a sandbox."""

from __future__ import annotations

from typing import cast

import pytest

from services.core.errors import NotFound, SandboxUnavailable
from services.session.harness.environment import EnvironmentPort
from services.session.harness.patch import (
    AddFile,
    DeleteFile,
    PatchError,
    UpdateFile,
    apply_hunks,
    apply_patch,
    parse_patch,
    workspace_path,
)

SOURCE = "def greet():\n    print('hi')\n\n\ndef leave():\n    print('bye')\n"


def _update(body: str) -> UpdateFile:
    (op,) = parse_patch(f"*** Begin Patch\n*** Update File: app.py\n{body}\n*** End Patch")
    assert isinstance(op, UpdateFile)
    return op


def test_a_patch_lists_its_file_operations_in_order() -> None:
    ops = parse_patch(
        "*** Begin Patch\n"
        "*** Add File: new.txt\n+one\n+two\n"
        "*** Delete File: old.txt\n"
        "*** Update File: app.py\n*** Move to: src/app.py\n@@ def greet():\n-    print('hi')\n+    print('hello')\n"
        "*** End Patch\n"
    )
    assert ops[0] == AddFile("new.txt", "one\ntwo\n")
    assert ops[1] == DeleteFile("old.txt")
    assert isinstance(ops[2], UpdateFile) and ops[2].move_to == "src/app.py"
    assert ops[2].hunks[0].anchor == "def greet():"


def test_a_hunk_replaces_the_lines_it_matches_and_keeps_the_rest() -> None:
    op = _update("@@\n def leave():\n-    print('bye')\n+    print('goodbye')")
    assert apply_hunks("app.py", SOURCE, op.hunks) == SOURCE.replace("'bye'", "'goodbye'")


def test_an_anchor_selects_which_of_two_identical_blocks_changes() -> None:
    text = "a:\n    x = 1\nb:\n    x = 1\n"
    op = _update("@@ b:\n-    x = 1\n+    x = 2")
    assert apply_hunks("app.py", text, op.hunks) == "a:\n    x = 1\nb:\n    x = 2\n"


def test_context_matches_despite_trailing_whitespace() -> None:
    op = _update("@@\n-    print('hi')   \n+    print('hello')")
    assert "print('hello')" in apply_hunks("app.py", SOURCE, op.hunks)


def test_lines_only_added_go_to_the_end_of_the_file() -> None:
    op = _update("@@\n+# end")
    assert apply_hunks("app.py", SOURCE, op.hunks) == SOURCE + "# end\n"


def test_end_of_file_anchors_a_hunk_at_the_end() -> None:
    text = "x\ny\nx\n"
    op = _update("@@\n-x\n+z\n*** End of File")
    assert apply_hunks("app.py", text, op.hunks) == "x\ny\nz\n"


def test_a_hunk_that_does_not_match_is_an_error_naming_the_file() -> None:
    op = _update("@@\n-    print('nope')\n+    print('x')")
    with pytest.raises(PatchError, match="app.py"):
        apply_hunks("app.py", SOURCE, op.hunks)


@pytest.mark.parametrize(
    "patch",
    [
        "",
        "*** Update File: a\n@@\n-x\n+y\n*** End Patch",
        "*** Begin Patch\n*** Update File: a\n@@\n-x\n+y",
        "*** Begin Patch\n*** End Patch",
        "*** Begin Patch\n*** Add File: a\nno plus\n*** End Patch",
        "*** Begin Patch\n*** Update File: a\n*** End Patch",
        "*** Begin Patch\n*** Update File: a\n@@\n?x\n*** End Patch",
        "*** Begin Patch\n*** Rename File: a\n*** End Patch",
        "*** Begin Patch\n*** Delete File: \n*** End Patch",
    ],
)
def test_malformed_patches_are_refused(patch: str) -> None:
    with pytest.raises(PatchError):
        parse_patch(patch)


@pytest.mark.parametrize("path", ["../etc/passwd", "/etc/passwd", "a/../../x", "/workspace", ".", "a\x00b", "a/" + "x" * 300])
def test_paths_outside_the_workspace_are_refused(path: str) -> None:
    with pytest.raises(PatchError):
        workspace_path(path)


def test_relative_and_absolute_workspace_paths_name_the_same_file() -> None:
    assert workspace_path("src/a.py") == workspace_path("/workspace/src/a.py") == "/workspace/src/a.py"


class _MemoryFiles:
    """The file half of the environment port, in memory; ``fail_on`` makes
    writing that path fail as an unreachable sandbox would."""

    def __init__(self, files: dict[str, bytes], fail_on: str | None = None) -> None:
        self.files = dict(files)
        self.fail_on = fail_on

    async def read_file(self, path: str, *, limit: int) -> tuple[bytes, bool]:
        if path not in self.files:
            raise NotFound(f"{path} not found")
        return self.files[path][:limit], len(self.files[path]) > limit

    async def write_file(self, path: str, data: bytes) -> None:
        if path == self.fail_on:
            raise SandboxUnavailable("the sandbox is unavailable")
        self.files[path] = data

    async def remove_file(self, path: str) -> None:
        del self.files[path]


MOVE_AND_ADD = """*** Begin Patch
*** Update File: a.txt
*** Move to: b.txt
@@
-one
+uno
*** Delete File: bin.dat
*** Add File: c.txt
+three
*** End Patch"""


async def test_a_patch_applies_through_the_port_and_deletes_binary_files() -> None:
    env = _MemoryFiles({"/workspace/a.txt": b"one\ntwo\n", "/workspace/bin.dat": b"\xff\xfe"})
    result = await apply_patch(cast(EnvironmentPort, env), MOVE_AND_ADD)
    assert env.files == {"/workspace/b.txt": b"uno\ntwo\n", "/workspace/c.txt": b"three\n"}
    assert result.changes == [("D", "a.txt"), ("A", "b.txt"), ("D", "bin.dat"), ("A", "c.txt")]


async def test_a_write_that_fails_midway_restores_the_files_already_changed() -> None:
    before = {"/workspace/a.txt": b"one\ntwo\n", "/workspace/bin.dat": b"\xff\xfe"}
    env = _MemoryFiles(before, fail_on="/workspace/c.txt")
    with pytest.raises(SandboxUnavailable):
        await apply_patch(cast(EnvironmentPort, env), MOVE_AND_ADD)
    assert env.files == before
