"""Fixtures shared by the whole suite: the PostgreSQL database and the
requirement switches CI sets (BERTH_REQUIRE_*), so required components are
never skipped silently there."""

from __future__ import annotations

import os
import shutil

import pytest


def require_or_skip(what: str, env_flag: str, reason: str) -> None:
    """Skips locally, fails in CI (where ``env_flag`` is set)."""
    if os.environ.get(env_flag) == "1":
        pytest.fail(f"{what} is required here ({env_flag}=1) but unavailable: {reason}")
    pytest.skip(f"{what} unavailable: {reason}")


@pytest.fixture(scope="session")
def bwrap_available() -> None:
    if shutil.which("bwrap") is None:
        require_or_skip("bubblewrap", "BERTH_REQUIRE_BWRAP", "bwrap not on PATH (apt-get install -y bubblewrap)")


@pytest.fixture(autouse=True)
def _reap_sandboxes(tmp_path: object) -> object:
    """Sandboxes deliberately outlive the service that created them, so every
    test destroys the local sandboxes left under its temporary directory."""
    yield
    import asyncio
    from pathlib import Path

    from services.sandbox.backends.local import LocalBackend

    root = Path(str(tmp_path))
    data_dirs = {p.parent for p in root.glob("**/sandboxes") if p.is_dir()}
    if not data_dirs:
        return

    async def reap() -> None:
        for data_dir in data_dirs:
            backend = LocalBackend(data_dir, isolation="none")
            for handle in await backend.adopt():
                try:
                    await backend.destroy(handle)
                except Exception:
                    pass

    asyncio.run(reap())
