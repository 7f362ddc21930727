"""Pure rules: workspace paths and capability archives."""

from __future__ import annotations

import base64
import io
import json
import zipfile

import pytest

from services.core.errors import InvalidArgument, PathOutsideWorkspace
from services.environment.setup_steps import parse_capabilities
from services.environment.workspace_paths import workspace_dir_path, workspace_file_path


def archive(**members: str) -> str:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for name, text in members.items():
            zf.writestr(name.replace("__", "/"), text)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize("path", ["/workspace/a", "/workspace/a/b.txt", "/workspace/.skills/x"])
def test_normalized_paths_under_the_workspace_are_accepted(path: str) -> None:
    assert workspace_file_path(path) == path


@pytest.mark.parametrize("path", ["/workspace", "/workspace/", "a", "/workspace/a/../../etc", "/workspace//a", "/tmp/x", "/workspace\x00/a"])
def test_other_file_paths_are_outside_the_workspace(path: str) -> None:
    with pytest.raises(PathOutsideWorkspace):
        workspace_file_path(path)


def test_directories_default_to_the_workspace_and_accept_a_trailing_slash() -> None:
    assert workspace_dir_path("") == "/workspace"
    assert workspace_dir_path("/workspace/") == "/workspace"
    assert workspace_dir_path("/workspace/out/") == "/workspace/out"
    with pytest.raises(PathOutsideWorkspace):
        workspace_dir_path("/")


def test_an_archive_escaping_its_directory_is_rejected() -> None:
    raw = json.dumps([{"type": "inline", "name": "evil", "data": archive(**{"..__..__etc__passwd": "x"})}])
    with pytest.raises(ValueError):
        parse_capabilities(raw, kind="skill", max_bytes=1 << 20)


def test_an_archive_larger_than_the_limit_is_rejected() -> None:
    raw = json.dumps([{"type": "inline", "name": "big", "data": archive(**{"SKILL.md": "x" * 100})}])
    with pytest.raises(ValueError):
        parse_capabilities(raw, kind="skill", max_bytes=10)


def test_skill_references_and_inline_skills_parse_in_order() -> None:
    raw = json.dumps(
        [
            {"type": "skill_reference", "skill_id": "skill_1", "version": "latest"},
            {"type": "inline", "name": "fmt", "description": "d", "source": {"type": "base64", "data": archive(**{"SKILL.md": "# f"})}},
        ]
    )
    parsed = parse_capabilities(raw, kind="skill", max_bytes=1 << 20)
    assert [(c.kind, c.name) for c in parsed] == [("skill_reference", "skill_1"), ("inline", "fmt")]
    with pytest.raises(ValueError):
        parse_capabilities(raw, kind="plugin", max_bytes=1 << 20)  # plugins are inline only


@pytest.mark.parametrize(
    "path",
    [
        "/workspace/" + "n" * 256,
        "/workspace/" + "/".join(["p" * 100] * 50),
        "/workspace/" + "d/" * 2000 + "f",
        "/workspace/" + "d/" * 127 + "f",
    ],
)
def test_paths_too_long_or_too_deep_are_invalid_arguments_for_files_and_directories(path: str) -> None:
    with pytest.raises(InvalidArgument):
        workspace_file_path(path)
    with pytest.raises(InvalidArgument):
        workspace_dir_path(path)


def test_paths_at_the_length_and_depth_bounds_are_accepted() -> None:
    for path in ("/workspace/" + "n" * 255, "/workspace/" + "d/" * 126 + "f"):
        assert workspace_file_path(path) == path
