"""Running a host tool (mkfs.ext4, nft...) for a sandbox's set-up."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Sequence

__all__ = ["TOOL_PATH", "run_tool"]

# Host tools come from the system's directories only, never from a PATH the
# service inherited.
TOOL_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"


async def run_tool(argv: Sequence[str], *, error: type[Exception], timeout_s: float, stdin: bytes | None = None) -> None:
    """Runs ``argv`` to completion, raising ``error`` (with its output) when
    it cannot start, exceeds ``timeout_s`` (it is killed) or exits non-zero.
    In a worker thread: spawning from the event loop blocks it until the
    child has exec'd, and many sandboxes start at once."""
    try:
        done = await asyncio.to_thread(
            subprocess.run,
            list(argv),
            input=stdin,
            stdin=subprocess.DEVNULL if stdin is None else None,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={"PATH": TOOL_PATH},
            timeout=timeout_s,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise error(f"{argv[0]} failed: {exc}") from exc
    if done.returncode != 0:
        raise error(f"{argv[0]} failed ({done.returncode}): {done.stdout.decode(errors='replace').strip()}")
