"""The official openai **Node** SDK (``openai`` on npm, pinned in
``tests/e2e/node/package.json``) against the gateway with only ``baseURL``
changed: ``node/conformance.mjs`` creates a session with a streamed
creation and reads its result with the SDK's collector, lists and pages
sessions, items and turns, answers an application function through
``sessions.stream``'s tool handlers, updates the session, replays its event
log, uses environments and vaults, checks the SDK's error classes, and
deletes a session. It prints what the calls returned; this test asserts
on that report."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from e2e_stack import Stack, running_stack

NODE_DIR = Path(__file__).parent / "node"

pytestmark = pytest.mark.asyncio(loop_scope="module")


def _node() -> str:
    """The node binary; ``make test`` installs the pinned SDK from the lock file."""
    node = shutil.which("node")
    assert node is not None, "node is needed (apt-get install -y nodejs npm)"
    assert (NODE_DIR / "node_modules" / "openai" / "package.json").is_file(), "run `make test` (it runs npm ci in tests/e2e/node)"
    return node


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory, bwrap_available: None) -> AsyncIterator[Stack]:
    async with running_stack(tmp_path_factory.mktemp("node-sdk") / "berth") as s:
        yield s


async def test_the_official_node_sdk_runs_sessions_tools_and_errors_against_berth(stack: Stack) -> None:
    node = _node()
    env = {
        **os.environ,
        "BERTH_BASE_URL": stack.base_url,
        "BERTH_KEY": stack.key,
        "BERTH_OTHER_KEY": await stack.new_key(),
    }
    process = await asyncio.create_subprocess_exec(
        node, "conformance.mjs", cwd=NODE_DIR, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    async with asyncio.timeout(180):
        out, err = await process.communicate()
    assert process.returncode == 0, err.decode()[-4000:]
    report = json.loads(out.decode().strip().splitlines()[-1])

    assert report["create_stream"]["turn_status"] == "completed"
    assert report["create_stream"]["output_text"] == "all done from node"
    assert report["session"]["status"] == "idle" and report["session"]["object"] == "agent.session"
    assert report["session"]["metadata"] == {"sdk": "node"}
    assert report["session"]["spend_control"] == {"limit": None, "consumed": 0}
    assert report["listed_ids"][0] == report["create_stream"]["session_id"]
    assert "command_execution" in report["items"]["types"], report["items"]
    assert "node-hi" in json.dumps(report["items"]["command"])
    assert report["turns"] == [{"status": "completed", "object": "agent.session.turn"}]

    assert report["stream"]["handler_args"] == [{"key": "k"}]
    assert report["stream"]["turn_status"] == "completed"
    assert report["stream"]["output_text"] == "the value came back"
    assert report["stream"]["saw_requires_action"] is True
    assert report["stream"]["last"] == "agent.session.idle"

    assert report["updated"] == {"metadata": {"sdk": "node", "step": "4"}, "limit": 1000}
    assert report["log_head"][0] == "agent.session.created"
    assert report["environment"] == {"id_prefix": "env", "attached_environment": True}
    assert report["vault"] == {"listed": True, "deleted": True}

    errors = report["errors"]
    assert (errors["missing"]["status"], errors["missing"]["code"]) == (404, "not_found")
    assert (errors["other_org"]["status"], errors["other_org"]["code"]) == (404, "not_found")
    assert (errors["bad_input"]["status"], errors["bad_input"]["param"]) == (400, "review")
    assert report["deleted"] == {"deleted": True, "id": True, "after": 404}
