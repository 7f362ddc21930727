"""The apply_patch format: parsing and matching hunks, without a sandbox."""

from __future__ import annotations

import pytest

from services.session.harness.patch import (
    AddFile,
    DeleteFile,
    PatchError,
    UpdateFile,
    apply_hunks,
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
