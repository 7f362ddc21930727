"""Fixtures of the end-to-end tests. ``Stack`` and ``start_stack`` live in
``e2e_stack`` (importable from test modules) and are re-exported here."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from e2e_stack import Stack, destroy_sandboxes, start_stack

__all__ = ["Stack", "start_stack", "destroy_sandboxes", "stack"]


@pytest.fixture
async def stack(tmp_path: Path, bwrap_available: None) -> AsyncIterator[Stack]:
    s, stop = await start_stack(tmp_path / "berth")
    try:
        yield s
    finally:
        await stop()
