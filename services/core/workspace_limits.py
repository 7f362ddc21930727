"""How long and how deep a workspace path may be: the one rule the gateway
and the Environment service both apply before a path reaches a sandbox.

The bounds are Linux's (PATH_MAX 4096 bytes for a whole path, NAME_MAX 255
bytes for one component, both as UTF-8) and 128 components (``/workspace``
included): far beyond real trees and well inside what a daemon, an error
message and gRPC metadata can carry.
"""

from __future__ import annotations

__all__ = ["PATH_MAX", "NAME_MAX", "MAX_PATH_DEPTH", "path_limit_problem"]

PATH_MAX = 4096
NAME_MAX = 255
MAX_PATH_DEPTH = 128  # components, /workspace included


def path_limit_problem(path: str) -> str | None:
    """What makes ``path`` too long or too deep, or None when it fits."""
    if len(path.encode("utf-8", "surrogatepass")) > PATH_MAX:
        return f"must be at most {PATH_MAX} bytes long"
    components = [part for part in path.split("/") if part]
    if len(components) > MAX_PATH_DEPTH:
        return f"must be at most {MAX_PATH_DEPTH} directories deep"
    if any(len(part.encode("utf-8", "surrogatepass")) > NAME_MAX for part in components):
        return f"must not have a component over {NAME_MAX} bytes"
    return None
