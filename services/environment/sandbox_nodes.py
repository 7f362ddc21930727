"""Several Sandbox service nodes behind one ``Compute``.

Each node is one Sandbox service with its own backend (a Docker engine or a
bubblewrap host), named in ``BERTH_SANDBOX_ADDRS``. Placement picks a node
for a new sandbox; the environment's row records it (``sandbox_node``)
before CreateSandbox runs, and every later call goes to the node the
``SandboxRef`` built from that row names, so any Environment replica routes
alike. A recorded empty name is the default node, the first configured.

A node that does not answer makes its own sandboxes ``SandboxUnavailable``,
as the one Sandbox service did before; the other nodes' sandboxes are not
affected. A row naming a node that is no longer configured is unavailable
too, never routed elsewhere: its sandbox does not exist anywhere else.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping, Sequence

from berth.common.v1 import common_pb2
from berth.sandbox.v1 import sandbox_pb2
from services.core.errors import BerthError, SandboxUnavailable
from services.core.logging import get_logger
from services.environment.compute import EnvironmentSandbox, ExecEvent, ProcessStart, SandboxClient, SandboxRef, SandboxSpec

__all__ = ["SandboxNodes"]

log = get_logger(__name__)

# A placement whose CreateSandbox never comes (its setup lost its lease, say)
# stops counting against its node after this long.
_PLACING_TTL_S = 120.0


class SandboxNodes:
    """``Compute`` and ``SandboxInventory`` over named nodes, the default first."""

    def __init__(self, nodes: Mapping[str, SandboxClient], *, placement_timeout_s: float) -> None:
        if not nodes:
            raise ValueError("at least one sandbox node is required")
        self._nodes = dict(nodes)
        self._names = list(nodes)
        self._placement_timeout_s = placement_timeout_s
        # Per node, expiry times of this process's placements whose
        # CreateSandbox has not returned yet: placements running at the same
        # time see each other before the nodes count their sandboxes.
        self._placing: dict[str, list[float]] = {name: [] for name in self._names}

    def node_names(self) -> Sequence[str]:
        return list(self._names)

    def _client(self, sandbox: SandboxRef) -> SandboxClient:
        client = self._nodes.get(sandbox.node or self._names[0])
        if client is None:
            raise SandboxUnavailable(
                f"sandbox {sandbox.sandbox_id} is on sandbox node {sandbox.node}, which is not configured"
            )
        return client

    # Placement ----------------------------------------------------------------

    async def place_sandbox(self, previous_node: str | None) -> str:
        if len(self._names) == 1:
            # One node: nothing to choose, and no extra call on the way.
            return self._names[0]
        if previous_node is not None:
            previous = previous_node or self._names[0]
            if previous in self._nodes and await self._load(previous) is not None:
                return self._placed(previous)
        loads = await asyncio.gather(*(self._load(name) for name in self._names))
        answered = [
            (load + self._in_flight(name), i)
            for i, (name, load) in enumerate(zip(self._names, loads, strict=True))
            if load is not None
        ]
        if not answered:
            raise SandboxUnavailable("no sandbox node is reachable")
        load, index = min(answered)
        log.info("sandbox_node_placed", node=self._names[index], load=load)
        return self._placed(self._names[index])

    def _in_flight(self, name: str) -> int:
        now = time.monotonic()
        self._placing[name] = [t for t in self._placing[name] if t > now]
        return len(self._placing[name])

    def _placed(self, name: str) -> str:
        self._placing[name].append(time.monotonic() + _PLACING_TTL_S)
        return name

    async def _load(self, name: str) -> int | None:
        """The node's live sandboxes, or None when it does not answer in time."""
        try:
            async with asyncio.timeout(self._placement_timeout_s):
                return await self._nodes[name].count_live_sandboxes(timeout_s=self._placement_timeout_s)
        except (BerthError, TimeoutError) as exc:
            log.warning("sandbox_node_skipped", node=name, error=getattr(exc, "message", "") or type(exc).__name__)
            return None

    # Compute ------------------------------------------------------------------

    async def create_sandbox(self, sandbox: SandboxRef, spec: SandboxSpec) -> None:
        client = self._client(sandbox)
        try:
            await client.create_sandbox(sandbox.sandbox_id, spec)
        finally:
            placing = self._placing.get(sandbox.node or self._names[0])
            if placing:
                placing.pop(0)

    async def destroy_sandbox(self, sandbox: SandboxRef) -> None:
        await self._client(sandbox).destroy_sandbox(sandbox.sandbox_id)

    async def update_secret_substitutions(
        self, sandbox: SandboxRef, substitutions: Sequence[sandbox_pb2.SecretSubstitution]
    ) -> bool:
        return await self._client(sandbox).update_secret_substitutions(sandbox.sandbox_id, substitutions)

    async def sandbox_alive(self, sandbox: SandboxRef) -> bool:
        return await self._client(sandbox).sandbox_alive(sandbox.sandbox_id)

    def exec(
        self,
        sandbox: SandboxRef,
        *,
        argv: Sequence[str] = (),
        shell: str = "",
        cwd: str = "",
        env: Mapping[str, str] | None = None,
        timeout_ms: int = 0,
    ) -> AsyncIterator[ExecEvent]:
        # The node's own iterator, not a wrapper: closing or cancelling it
        # cancels the call on that node at once.
        return self._client(sandbox).exec(
            sandbox.sandbox_id, argv=argv, shell=shell, cwd=cwd, env=env, timeout_ms=timeout_ms
        )

    async def start_process(self, sandbox: SandboxRef, start: ProcessStart) -> sandbox_pb2.Process:
        return await self._client(sandbox).start_process(sandbox.sandbox_id, start)

    def run_process(self, sandbox: SandboxRef, start: ProcessStart) -> AsyncIterator[sandbox_pb2.Process | ExecEvent]:
        return self._client(sandbox).run_process(sandbox.sandbox_id, start)

    def attach_process(self, sandbox: SandboxRef, process_id: str, *, from_seq: int = 0) -> AsyncIterator[ExecEvent]:
        return self._client(sandbox).attach_process(sandbox.sandbox_id, process_id, from_seq=from_seq)

    async def kill_process(self, sandbox: SandboxRef, process_id: str, *, signal: int = 0) -> sandbox_pb2.Process | None:
        return await self._client(sandbox).kill_process(sandbox.sandbox_id, process_id, signal=signal)

    async def list_processes(self, sandbox: SandboxRef) -> list[sandbox_pb2.Process]:
        return await self._client(sandbox).list_processes(sandbox.sandbox_id)

    async def write_process_stdin(
        self, sandbox: SandboxRef, process_id: str, data: bytes, *, close: bool
    ) -> sandbox_pb2.Process:
        return await self._client(sandbox).write_process_stdin(sandbox.sandbox_id, process_id, data, close=close)

    async def remove_file(self, sandbox: SandboxRef, path: str) -> None:
        await self._client(sandbox).remove_file(sandbox.sandbox_id, path)

    async def make_directory(self, sandbox: SandboxRef, path: str) -> None:
        await self._client(sandbox).make_directory(sandbox.sandbox_id, path)

    async def write_file(self, sandbox: SandboxRef, path: str, data: bytes, *, mode: int = 0) -> common_pb2.FileEntry:
        return await self._client(sandbox).write_file(sandbox.sandbox_id, path, data, mode=mode)

    def read_file(self, sandbox: SandboxRef, path: str) -> AsyncIterator[tuple[bytes, int]]:
        return self._client(sandbox).read_file(sandbox.sandbox_id, path)

    async def list_files(self, sandbox: SandboxRef, path: str, *, recursive: bool) -> list[common_pb2.FileEntry]:
        return await self._client(sandbox).list_files(sandbox.sandbox_id, path, recursive=recursive)

    async def start_mcp_broker(
        self, sandbox: SandboxRef, label: str, transport: sandbox_pb2.McpTransport
    ) -> tuple[sandbox_pb2.McpBroker, bool]:
        return await self._client(sandbox).start_mcp_broker(sandbox.sandbox_id, label, transport)

    async def list_mcp_brokers(self, sandbox: SandboxRef) -> list[sandbox_pb2.McpBroker]:
        return await self._client(sandbox).list_mcp_brokers(sandbox.sandbox_id)

    async def send_mcp_message(self, sandbox: SandboxRef, label: str, message_json: str, *, timeout_s: float) -> str:
        return await self._client(sandbox).send_mcp_message(sandbox.sandbox_id, label, message_json, timeout_s=timeout_s)

    async def stop_mcp_broker(self, sandbox: SandboxRef, label: str, *, timeout_s: float) -> sandbox_pb2.McpBroker:
        return await self._client(sandbox).stop_mcp_broker(sandbox.sandbox_id, label, timeout_s=timeout_s)

    async def close_mcp_upstream(self, sandbox: SandboxRef, label: str, *, timeout_s: float) -> bool:
        return await self._client(sandbox).close_mcp_upstream(sandbox.sandbox_id, label, timeout_s=timeout_s)

    # SandboxInventory ---------------------------------------------------------

    async def list_environment_sandboxes(self, node: str) -> list[EnvironmentSandbox]:
        client = self._nodes.get(node)
        if client is None:
            raise SandboxUnavailable(f"sandbox node {node} is not configured")
        return await client.list_environment_sandboxes()

    async def destroy_org_sandbox(self, org_id: str, sandbox: SandboxRef) -> None:
        await self._client(sandbox).destroy_org_sandbox(org_id, sandbox.sandbox_id)
