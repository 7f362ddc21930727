"""The workspace as requests name it, and the environment commands get.

Paths are ``/workspace/...`` or relative to the workspace; ``/workspace``
maps to the ``--workspace`` root, which is a host directory when unconfined.
"""

from __future__ import annotations

import os
import posixpath
from typing import Any, Callable, Dict, Optional

from .protocol import Json, OpError, opt_str

VIRTUAL_ROOT = "/workspace"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class Workspace:
    """The workspace root and the sandbox's extra environment (``--env-file``
    then ``--env``), which ``reload`` replaces for commands started later."""

    def __init__(self, workspace: str, extra_env: Dict[str, str], env_loader: Optional[Callable[[], Dict[str, str]]] = None) -> None:
        self.root = os.path.realpath(workspace)
        self.extra_env = extra_env
        self.env_loader = env_loader

    def reload(self) -> int:
        """Re-reads the extra environment; returns how many variables it
        holds. A failure keeps the old environment."""
        if self.env_loader is None:
            raise OpError("failed_precondition", "this daemon was started without an environment to reload")
        try:
            env = self.env_loader()
        except (OSError, ValueError) as exc:
            raise OpError("failed_precondition", "cannot reload the environment: %s" % exc) from None
        self.extra_env = env
        return len(env)

    def to_host(self, value: str) -> str:
        if self.root == VIRTUAL_ROOT:
            return value
        if value == VIRTUAL_ROOT or value.startswith(VIRTUAL_ROOT + "/"):
            return self.root + value[len(VIRTUAL_ROOT) :]
        return value

    def to_virtual(self, real: str) -> str:
        rel = os.path.relpath(real, self.root)
        return VIRTUAL_ROOT if rel == "." else VIRTUAL_ROOT + "/" + rel

    def within_root(self, real: str) -> bool:
        return real == self.root or real.startswith(self.root.rstrip("/") + "/")

    def resolve(self, path: Any, follow_final: bool = True) -> str:
        """Maps a request path onto the host and enforces confinement."""
        if not isinstance(path, str) or path == "" or "\0" in path:
            raise OpError("invalid_argument", "path must be a non-empty string")
        if path == VIRTUAL_ROOT or path.startswith(VIRTUAL_ROOT + "/"):
            rel = path[len(VIRTUAL_ROOT) :]
        elif self.within_root(path):
            rel = path[len(self.root) :]
        elif path.startswith("/"):
            raise OpError("invalid_argument", "%s is outside %s" % (path, VIRTUAL_ROOT))
        else:
            rel = path
        rel = rel.lstrip("/")
        normal = posixpath.normpath(rel) if rel else "."
        if normal == ".." or normal.startswith("../"):
            raise OpError("invalid_argument", "%s escapes %s" % (path, VIRTUAL_ROOT))
        lexical = self.root if normal == "." else os.path.join(self.root, normal)
        if lexical == self.root:
            return lexical
        if follow_final:
            real = os.path.realpath(lexical)
        else:
            real = os.path.join(os.path.realpath(os.path.dirname(lexical)), os.path.basename(lexical))
        if not self.within_root(real):
            raise OpError("permission_denied", "%s resolves outside %s through a symlink" % (path, VIRTUAL_ROOT))
        return real

    def cwd(self, req: Json) -> str:
        cwd = opt_str(req, "cwd")
        if cwd is None or cwd == "":
            return self.root
        real = self.to_host(cwd) if cwd.startswith("/") else os.path.join(self.root, cwd)
        if not os.path.isdir(real):
            raise OpError("invalid_argument", "cwd %s is not a directory" % cwd)
        return real

    def command_env(self, variables: Dict[str, str]) -> Dict[str, str]:
        """A command's environment: the basics every command gets, then
        ``variables``; paths under ``/workspace`` map onto the host root when
        unconfined. (The reaper adds the command's marker.)"""
        env = {"PATH": DEFAULT_PATH, "HOME": VIRTUAL_ROOT, "LANG": "C.UTF-8"}
        env.update(variables)
        if self.root != VIRTUAL_ROOT:
            env = {key: ":".join(self.to_host(part) for part in value.split(":")) for key, value in env.items()}
        env["BERTH_WORKSPACE"] = self.root
        return env

    def sandbox_env(self) -> Dict[str, str]:
        """The sandbox's environment: the daemon's own plus the extra one."""
        env = dict(os.environ)
        env.update(self.extra_env)
        return env
