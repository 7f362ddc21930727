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
