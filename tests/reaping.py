"""Destroying the sandboxes a test left behind. Sandboxes deliberately
outlive the service that created them, so the suite reaps them itself:
the root conftest under every test's ``tmp_path``, and the tests whose data
directory lies elsewhere by calling this directly."""

from __future__ import annotations

import contextlib
from pathlib import Path

__all__ = ["destroy_local_sandboxes"]


async def destroy_local_sandboxes(data_dir: Path) -> None:
    """Destroys every local sandbox kept under ``data_dir`` (the data
    directory of a Sandbox service), whatever state it is in."""
    from services.sandbox.backends.local import LocalBackend

    if not (data_dir / "sandboxes").is_dir():
        return
    backend = LocalBackend(data_dir, isolation="none")
    for handle in await backend.adopt():
        with contextlib.suppress(Exception):
            await backend.destroy(handle)
