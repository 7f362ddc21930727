"""Path rules for the sandbox workspace and per-session output directories."""

from __future__ import annotations

import posixpath
import re

from services.core.errors import InvalidArgument, PathOutsideWorkspace
from services.core.workspace_limits import path_limit_problem

__all__ = [
    "WORKSPACE",
    "OWNER_OUTPUT_DIR",
    "SESSIONS_OUTPUT_DIR",
    "session_output_dir",
    "workspace_file_path",
    "workspace_dir_path",
    "validate_session_id",
]

WORKSPACE = "/workspace"
OWNER_OUTPUT_DIR = "/workspace/outputs"
SESSIONS_OUTPUT_DIR = "/workspace/outputs/sessions"

_SESSION_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


def validate_session_id(session_id: str, *, param: str = "session_id") -> str:
    # Session IDs become path components of output directories.
    if not _SESSION_ID.match(session_id):
        raise InvalidArgument("session_id must be 1-128 letters, digits, '_' or '-'", param=param)
    return session_id


def session_output_dir(session_id: str) -> str:
    return f"{SESSIONS_OUTPUT_DIR}/{session_id}"


def _check(path: str, param: str, *, allow_root: bool) -> str:
    problem = path_limit_problem(path)
    if problem is not None:
        raise InvalidArgument(f"{param} {problem}", param=param)
    if not path.startswith("/"):
        raise PathOutsideWorkspace(f"{param} must be an absolute path under {WORKSPACE}", param=param)
    if "\x00" in path or posixpath.normpath(path) != path:
        raise PathOutsideWorkspace(f"{param} must be a normalized path under {WORKSPACE}", param=param)
    if path == WORKSPACE:
        if allow_root:
            return path
        raise PathOutsideWorkspace(f"{param} must name a file under {WORKSPACE}", param=param)
    if not path.startswith(WORKSPACE + "/"):
        raise PathOutsideWorkspace(f"{param} must be under {WORKSPACE}", param=param)
    return path


def workspace_file_path(path: str, *, param: str = "path") -> str:
    """An absolute, normalized path strictly inside /workspace."""
    return _check(path, param, allow_root=False)


def workspace_dir_path(path: str, *, param: str = "path") -> str:
    """A directory: /workspace itself or below; empty means /workspace and a
    trailing slash is accepted."""
    if not path:
        return WORKSPACE
    if len(path) > 1 and path.endswith("/"):
        path = path.rstrip("/")
    return _check(path, param, allow_root=True)
