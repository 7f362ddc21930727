"""Sandbox lifecycle and operations, independent of gRPC.

The manager owns the rows, the backend and one daemon connection per
sandbox. Every operation marks the sandbox active and resumes it first if it
is paused, so pausing is invisible to callers; an idle reaper pauses
sandboxes with no operation in flight, no recent activity and no keepalive
process.

A ``restricted`` sandbox also gets its egress proxy (``egress.py``) from the
manager: started with the sandbox and again on adoption after a restart
(from the policy stored in its row), stopped when it is destroyed.

Its ``environment_variable`` vault credentials (``secrets``) get one new
placeholder each, which goes into the sandbox's env under the credential's
variable; the secrets themselves go only to its egress proxy, and to its
row sealed with the sandbox key ring (``secrets_ciphertext``), so a
restarted service substitutes them again. A sandbox with secrets and any
network but ``restricted``, or without an enforced egress proxy, is refused.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from services.core.db import Database
from services.core.errors import Conflict, FailedPrecondition, InvalidArgument, NotFound, SandboxUnavailable
from services.core.key_ring import InvalidToken, KeyRing
from services.core.logging import get_logger
from services.core.metrics import SANDBOXES
from services.sandbox import repository as repo
from services.sandbox.backends.base import (
    EGRESS_PROXY_PORT,
    EGRESS_SOCKET_IN_SANDBOX,
    BackendHandle,
    NetworkPolicy,
    SandboxBackend,
    SandboxSpec,
)
from services.sandbox.daemon_client import DaemonClient, DaemonError, DaemonUnavailable
from services.sandbox.egress import EgressOptions, EgressPolicy, EgressProxies, parse_host
from services.sandbox.egress_substitution import Substitution, new_placeholder
from services.sandbox.isolation.sizes import size_for
from services.sandbox.mcp_http import SandboxHttpBrokers
from services.sandbox.models import SandboxRow
from services.sandbox.states import LIVE_STATES, SandboxState

__all__ = ["SandboxManager", "SandboxRecord", "CreateParams", "SecretParams"]

# Every state but the last one: ``destroyed`` is final.
_UNDESTROYED = (*LIVE_STATES, SandboxState.ERROR)
# A sandbox adopted while it was being created is running but still says so.
_PAUSABLE = (SandboxState.CREATING, SandboxState.RUNNING)
# How often the berth_sandboxes gauge is recounted (a Prometheus scrape is
# typically every 15 s or more).
GAUGE_REFRESH_S = 5.0

log = get_logger(__name__)


@dataclass(frozen=True)
class SecretParams:
    """An environment_variable credential for the sandbox's egress proxy."""

    env_name: str
    value: str = field(repr=False)
    any_allowed_host: bool = False
    allowed_hosts: tuple[str, ...] = ()
    credential_id: str = ""


@dataclass(frozen=True)
class CreateParams:
    sandbox_id: str
    labels: Mapping[str, str]
    network: Mapping[str, object]
    env: Mapping[str, str]
    size: int
    secrets: tuple[SecretParams, ...] = field(default=(), repr=False)


@dataclass
class SandboxRecord:
    sandbox_id: str
    org_id: str
    state: str
    backend: str
    isolation: str
    labels: dict[str, str]
    network: dict[str, object]
    size: int
    error: str
    created_at: float
    last_active_at: float

    @classmethod
    def from_row(cls, row: SandboxRow) -> SandboxRecord:
        return cls(
            sandbox_id=row.sandbox_id,
            org_id=row.org_id,
            state=row.state,
            backend=row.backend,
            isolation=row.isolation,
            labels=json.loads(row.labels_json),
            network=json.loads(row.network_json),
            size=row.size,
            error=row.error,
            created_at=row.created_at,
            last_active_at=row.last_active_at,
        )


@dataclass
class _Live:
    handle: BackendHandle
    client: DaemonClient
    org_id: str
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    in_flight: int = 0
    last_active: float = field(default_factory=time.monotonic)
    paused: bool = False
    # What the TLS of its HTTP MCP clients trusts (None: the host's store).
    ca_bundle: Path | None = None
    # The clients of the sandbox's environment-origin HTTP MCP servers.
    http_mcp: SandboxHttpBrokers = field(init=False)

    def __post_init__(self) -> None:
        self.http_mcp = SandboxHttpBrokers(self.client, ca_bundle=self.ca_bundle)

    async def close(self) -> None:
        await self.http_mcp.close()
        await self.client.close()


class SandboxManager:
    def __init__(
        self,
        db: Database,
        backend: SandboxBackend,
        *,
        backend_name: str,
        isolation: str,
        idle_pause_s: float,
        egress: EgressProxies | None = None,
        mcp_ca_bundle: Path | None = None,
        secret_keys: KeyRing | None = None,
    ) -> None:
        """``mcp_ca_bundle`` is what sandboxes trust (``BERTH_SANDBOX_CA_BUNDLE``),
        so their HTTP MCP clients' TLS trusts the same; None is the host's store.
        ``secret_keys`` seal the secrets of sandboxes; without them sandboxes
        with secrets are refused."""
        self._db = db
        self._secret_keys = secret_keys
        self._mcp_ca_bundle = mcp_ca_bundle
        self._backend = backend
        self._egress = egress or EgressProxies(EgressOptions())
        self._backend_name = backend_name
        self._isolation = isolation
        self._idle_pause_s = idle_pause_s
        self._live: dict[str, _Live] = {}
        self._create_locks: dict[str, asyncio.Lock] = {}
        self._reaper: asyncio.Task[None] | None = None
        self._gauge: asyncio.Task[None] | None = None

    # --- lifecycle of the manager itself -------------------------------------------------

    async def start(self) -> None:
        """Reconnects to sandboxes that outlived a previous service process."""
        adopted = {h.sandbox_id: h for h in await self._backend.adopt()}
        networks: list[tuple[str, BackendHandle, dict[str, object], list[Substitution]]] = []
        async with self._db.transaction() as s:
            for row in await repo.unsettled_sandboxes(s, LIVE_STATES):
                handle = adopted.get(row.sandbox_id)
                if handle is None:
                    await repo.transition(
                        s,
                        row.sandbox_id,
                        (row.state,),
                        SandboxState.ERROR,
                        error="sandbox did not survive a restart of its host",
                        now=None,
                    )
                    continue
                live = _Live(
                    handle=handle,
                    client=DaemonClient(self._backend.socket_path(handle)),
                    org_id=row.org_id,
                    ca_bundle=self._mcp_ca_bundle,
                )
                live.paused = row.state == SandboxState.PAUSED
                self._live[row.sandbox_id] = live
                substitutions = [sub for _, sub in self._unseal(row)]
                networks.append((row.sandbox_id, handle, json.loads(row.network_json), substitutions))
                log.info("sandbox_adopted", sandbox_id=row.sandbox_id, state=row.state)
        for sandbox_id, handle, network, substitutions in networks:
            # sandboxd kept its relay; only the proxy died with the old process.
            try:
                await self._start_egress(sandbox_id, handle, network, relay=None, substitutions=substitutions)
            except Exception as exc:  # the sandbox stays usable, only offline
                log.warning("sandbox_egress_failed", sandbox_id=sandbox_id, error=str(exc))
        if self._idle_pause_s > 0:
            self._reaper = asyncio.create_task(self._reap_idle(), name="sandbox-idle-reaper")
        await self._update_gauge()
        self._gauge = asyncio.create_task(self._refresh_gauge(), name="sandbox-gauge")

    async def close(self) -> None:
        for task in (self._reaper, self._gauge):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        for live in self._live.values():
            await live.close()
        await self._egress.close()

    # --- rows ---------------------------------------------------------------------------

    async def _row(self, org_id: str, sandbox_id: str) -> SandboxRecord:
        async with self._db.transaction(read_only=True) as s:
            row = await repo.get_sandbox(s, sandbox_id)
            if row is None or row.org_id != org_id or row.state == SandboxState.DESTROYED:
                raise NotFound(f"sandbox {sandbox_id} not found")
            return SandboxRecord.from_row(row)

    async def _set_state(
        self,
        sandbox_id: str,
        expected: tuple[str, ...],
        state: str,
        *,
        error: str = "",
        handle: BackendHandle | None = None,
    ) -> None:
        """A compare-and-set from one of the ``expected`` states; raises
        ``repo.IllegalTransition`` when another operation got there first."""
        async with self._db.transaction() as s:
            await repo.transition(
                s,
                sandbox_id,
                expected,
                state,
                now=time.time(),
                error=error,
                handle_json=handle.to_json() if handle is not None else None,
            )

    async def _update_gauge(self) -> None:
        async with self._db.transaction(read_only=True) as s:
            counts = await repo.count_by_state(s)
        for state in SandboxState:
            SANDBOXES.labels(state=state).set(counts.get(state, 0))

    async def _refresh_gauge(self) -> None:
        """Counts by state every GAUGE_REFRESH_S, off every transition's
        path: a count reads every row ever made (destroyed ones are kept)."""
        while True:
            await asyncio.sleep(GAUGE_REFRESH_S)
            try:
                await self._update_gauge()
            except Exception as exc:  # the next round tries again
                log.warning("sandbox_gauge_failed", error=str(exc))

    # --- transitions --------------------------------------------------------------------

    async def create(self, org_id: str, params: CreateParams) -> SandboxRecord:
        if not params.sandbox_id or len(params.sandbox_id) > 64 or not params.sandbox_id.replace("_", "").replace("-", "").isalnum():
            raise InvalidArgument("sandbox_id must be 1-64 characters of [A-Za-z0-9_-]", param="sandbox_id")
        self._check_secrets(params.network, params.secrets)
        lock = self._create_locks.setdefault(params.sandbox_id, asyncio.Lock())
        async with lock:
            network: dict[str, object] = dict(params.network)
            # (variable, substitution) pairs; new placeholders unless a row has some.
            secrets = [(secret.env_name, _substitution(secret)) for secret in params.secrets]
            async with self._db.transaction() as s:
                row = await repo.get_sandbox(s, params.sandbox_id)
                if row is not None:
                    # A retried create enforces the policy the row reports,
                    # with the placeholders and secrets of the first.
                    network = json.loads(row.network_json)
                    secrets = self._unseal(row)
                    if row.org_id != org_id:
                        raise Conflict(f"sandbox {params.sandbox_id} already exists")
                    if row.state in (SandboxState.RUNNING, SandboxState.PAUSED) and params.sandbox_id in self._live:
                        return SandboxRecord.from_row(row)
                    if row.state == SandboxState.DESTROYED:
                        raise Conflict(f"sandbox {params.sandbox_id} was destroyed; identities are not reused")
                now = time.time()
                if row is None:
                    row = SandboxRow(
                        sandbox_id=params.sandbox_id,
                        org_id=org_id,
                        state=SandboxState.CREATING,
                        backend=self._backend_name,
                        isolation=self._isolation,
                        labels_json=json.dumps(dict(params.labels)),
                        network_json=json.dumps(dict(params.network)),
                        env_json=json.dumps(dict(params.env)),
                        secrets_ciphertext=self._seal(secrets),
                        size=params.size,
                        handle_json="{}",
                        error="",
                        created_at=now,
                        last_active_at=now,
                    )
                    repo.insert_sandbox(s, row)
            egress = _egress_policy(network)
            placeholders = {name: sub.placeholder for name, sub in secrets}
            substitutions = [sub for _, sub in secrets]
            spec = SandboxSpec(
                sandbox_id=params.sandbox_id,
                network=_network_policy(network),
                allowed_domains=egress.allowed_domains,
                blocked_domains=egress.blocked_domains,
                env={**dict(params.env), **placeholders},
                labels={**dict(params.labels), "berth.sandbox_id": params.sandbox_id, "berth.org": org_id},
                size=size_for(params.size),
            )
            try:
                handle = await self._backend.create(spec)
            except Exception as exc:
                log.warning("sandbox_create_failed", sandbox_id=params.sandbox_id, error=str(exc))
                await self._set_state(params.sandbox_id, _UNDESTROYED, SandboxState.ERROR, error=str(exc))
                raise SandboxUnavailable(f"sandbox {params.sandbox_id} could not be created: {exc}") from exc
            client = DaemonClient(self._backend.socket_path(handle))
            try:
                await self._start_egress(params.sandbox_id, handle, network, relay=client, substitutions=substitutions)
            except Exception as exc:
                # Still without network, but a restricted sandbox that cannot
                # reach its allowed domains is not what was asked for.
                await client.close()
                await self._egress.stop(params.sandbox_id)
                log.warning("sandbox_egress_failed", sandbox_id=params.sandbox_id, error=str(exc))
                await self._set_state(params.sandbox_id, _UNDESTROYED, SandboxState.ERROR, error=f"egress proxy: {exc}", handle=handle)
                raise SandboxUnavailable(f"sandbox {params.sandbox_id} could not start its egress proxy: {exc}") from exc
            self._live[params.sandbox_id] = _Live(handle=handle, client=client, org_id=org_id, ca_bundle=self._mcp_ca_bundle)
            await self._set_state(params.sandbox_id, _UNDESTROYED, SandboxState.RUNNING, handle=handle)
            log.info("sandbox_created", sandbox_id=params.sandbox_id, backend=self._backend_name)
            return await self._row(org_id, params.sandbox_id)

    async def get(self, org_id: str, sandbox_id: str) -> SandboxRecord:
        return await self._row(org_id, sandbox_id)

    async def list_labeled(self, label_key: str, page_size: int, page_token: str) -> tuple[list[SandboxRecord], str]:
        """Sandboxes of every organization that carry ``label_key`` and are
        not destroyed, by ID: the input of the reconciler of whoever owns the
        identities behind that label."""
        if not label_key:
            raise InvalidArgument("label_key is required", param="label_key")
        async with self._db.transaction(read_only=True) as s:
            page = await repo.list_labeled_sandboxes(
                s, label_key, exclude_state=SandboxState.DESTROYED, page_size=_page_size(page_size), page_token=page_token
            )
        return [SandboxRecord.from_row(row) for row in page.rows], page.next_page_token

    async def count_live(self) -> int:
        """Sandboxes of every organization that hold resources here: the
        load the Environment service places new sandboxes by."""
        async with self._db.transaction(read_only=True) as s:
            return await repo.count_in_states(s, LIVE_STATES)

    async def destroy(self, org_id: str, sandbox_id: str) -> None:
        # Serialized with create of the same ID: a destroy that arrives while
        # the sandbox is being created waits for it and then removes it, so a
        # finishing create can never bring a destroyed sandbox back.
        async with self._create_locks.setdefault(sandbox_id, asyncio.Lock()):
            await self._destroy(org_id, sandbox_id)

    async def _destroy(self, org_id: str, sandbox_id: str) -> None:
        async with self._db.transaction() as s:
            row = await repo.get_sandbox(s, sandbox_id)
            if row is None or row.org_id != org_id:
                raise NotFound(f"sandbox {sandbox_id} not found")
            if row.state == SandboxState.DESTROYED:
                return
            handle_json = row.handle_json
        await self._egress.stop(sandbox_id)
        live = self._live.pop(sandbox_id, None)
        if live is not None:
            await live.close()
            await self._backend.destroy(live.handle)
        else:
            # Not held here (an `error` sandbox, say one that did not survive
            # a restart, or whose create failed half-way): what the backend
            # made for it still exists and goes through the backend too.
            handle = _stored_handle(handle_json) or self._backend.leftover_handle(sandbox_id)
            if handle is not None:
                try:
                    await self._backend.destroy(handle)
                except Exception as exc:
                    log.warning("sandbox_destroy_failed", sandbox_id=sandbox_id, error=str(exc))
                    raise SandboxUnavailable(f"sandbox {sandbox_id} could not be destroyed: {exc}") from exc
        await self._set_state(sandbox_id, _UNDESTROYED, SandboxState.DESTROYED)
        log.info("sandbox_destroyed", sandbox_id=sandbox_id)

    async def update_secrets(
        self, org_id: str, sandbox_id: str, secrets: tuple[SecretParams, ...]
    ) -> tuple[list[str], list[str]]:
        """Replaces the sandbox's substitutions after its credentials were
        rotated or deleted: (credential IDs substituted now, listed ones
        ignored). Matched by credential ID, a kept credential keeps its
        variable and placeholder (the sandbox's env does not change) and
        takes the new value and hosts; an unlisted one is removed; a listed
        one the sandbox was not created with is ignored, since only a new
        sandbox gets a new variable. Sealed in the row first, so a restarted
        service substitutes the new set, then given to the running proxy."""
        ids = [secret.credential_id for secret in secrets]
        if not all(ids) or len(set(ids)) != len(ids):
            raise InvalidArgument("secret substitutions need distinct credential IDs", param="secret_substitutions")
        given = {secret.credential_id: secret for secret in secrets}
        async with self._create_locks.setdefault(sandbox_id, asyncio.Lock()):
            async with self._db.transaction() as s:
                row = await repo.get_sandbox(s, sandbox_id)
                if row is None or row.org_id != org_id or row.state == SandboxState.DESTROYED:
                    raise NotFound(f"sandbox {sandbox_id} not found")
                # An unreadable row substitutes nothing; it is left as it is.
                existing = self._unseal(row)
                kept = [
                    (name, _substitution(given[sub.credential_id], placeholder=sub.placeholder))
                    for name, sub in existing
                    if sub.credential_id in given
                ]
                if kept:
                    self._check_secrets(json.loads(row.network_json), tuple(given[sub.credential_id] for _, sub in kept))
                if existing:
                    row.secrets_ciphertext = self._seal(kept)
            substitutions = [sub for _, sub in kept]
            self._egress.replace_substitutions(sandbox_id, substitutions)
        applied = [sub.credential_id for sub in substitutions]
        ignored = [i for i in ids if i not in applied]
        log.info("sandbox_secrets_updated", sandbox_id=sandbox_id, credential_ids=applied, ignored_credential_ids=ignored)
        return applied, ignored

    def _check_secrets(self, network: Mapping[str, object], secrets: tuple[SecretParams, ...]) -> None:
        if not secrets:
            return
        if _network_policy(network) != "restricted":
            raise InvalidArgument("secret substitution needs network access restricted", param="network.access")
        if self._isolation == "none":
            raise FailedPrecondition("secret substitution needs confined sandboxes (isolation none has no egress proxy)")
        if self._secret_keys is None:
            raise FailedPrecondition("secret substitution is not configured on this sandbox node")
        names = [secret.env_name for secret in secrets]
        if len(set(names)) != len(names) or not all(names):
            raise InvalidArgument("secret substitutions need distinct variable names", param="secret_substitutions")

    def _seal(self, secrets: list[tuple[str, Substitution]]) -> bytes | None:
        if not secrets:
            return None
        assert self._secret_keys is not None
        payload = [
            {
                "env_name": name,
                "placeholder": sub.placeholder,
                "value": sub.value,
                "any_allowed_host": sub.any_allowed_host,
                "allowed_hosts": sorted(str(h) for h in sub.allowed_hosts),
                "credential_id": sub.credential_id,
            }
            for name, sub in secrets
        ]
        return self._secret_keys.encrypt(json.dumps(payload).encode())

    def _unseal(self, row: SandboxRow) -> list[tuple[str, Substitution]]:
        """The (variable, substitution) pairs sealed in ``row``; none when it
        has none or no configured key opens them (its placeholders then
        leave unsubstituted, which exposes nothing)."""
        if not row.secrets_ciphertext:
            return []
        if self._secret_keys is None:
            log.warning("sandbox_secrets_unreadable", sandbox_id=row.sandbox_id, error="no sandbox secret keys")
            return []
        try:
            payload = json.loads(self._secret_keys.decrypt(row.secrets_ciphertext))
        except (InvalidToken, ValueError):
            log.warning("sandbox_secrets_unreadable", sandbox_id=row.sandbox_id, error="not sealed with a configured key")
            return []
        return [
            (
                str(item["env_name"]),
                _substitution(
                    SecretParams(
                        env_name=str(item["env_name"]),
                        value=str(item["value"]),
                        any_allowed_host=bool(item["any_allowed_host"]),
                        allowed_hosts=tuple(str(h) for h in item["allowed_hosts"]),
                        credential_id=str(item["credential_id"]),
                    ),
                    placeholder=str(item["placeholder"]),
                ),
            )
            for item in payload
        ]

    async def _start_egress(
        self,
        sandbox_id: str,
        handle: BackendHandle,
        network: Mapping[str, object],
        *,
        relay: DaemonClient | None,
        substitutions: list[Substitution],
    ) -> None:
        """Serves the egress proxy of a restricted sandbox and, given the
        daemon's client, starts the daemon's relay to it."""
        if _network_policy(network) != "restricted":
            return
        socket_path = self._backend.egress_socket_path(handle)
        if socket_path is None:
            # Unconfined (isolation none), or started before restricted was enforced.
            log.warning("sandbox_egress_not_enforced", sandbox_id=sandbox_id)
            return
        await self._egress.start(sandbox_id, socket_path, _egress_policy(network), substitutions)
        if relay is not None:
            await relay.start_egress_relay(EGRESS_PROXY_PORT, EGRESS_SOCKET_IN_SANDBOX)

    # --- operations ---------------------------------------------------------------------

    def _require_live(self, sandbox_id: str) -> _Live:
        live = self._live.get(sandbox_id)
        if live is None:
            raise SandboxUnavailable(f"sandbox {sandbox_id} is not running on this host")
        return live

    async def _resume_live(self, sandbox_id: str, live: _Live) -> None:
        if not live.paused:
            return
        async with live.lock:
            if live.paused:
                await self._backend.resume(live.handle)
                live.paused = False
                await self._set_state(sandbox_id, (SandboxState.PAUSED,), SandboxState.RUNNING)
                log.info("sandbox_resumed", sandbox_id=sandbox_id)

    @asynccontextmanager
    async def operation(self, org_id: str, sandbox_id: str) -> AsyncIterator[DaemonClient]:
        """Yields the daemon client of a running sandbox for one operation:
        checks ownership, resumes a paused sandbox, keeps it from idle pause
        while the operation runs, and turns connection failures into
        SandboxUnavailable (never into a replacement sandbox)."""
        live = self._live.get(sandbox_id)
        if live is None or live.org_id != org_id:
            # Not live here: the row decides between NotFound and unavailable.
            await self._row(org_id, sandbox_id)
            live = self._require_live(sandbox_id)
        live.in_flight += 1
        try:
            await self._resume_live(sandbox_id, live)
            try:
                yield live.client
            except DaemonUnavailable as exc:
                raise SandboxUnavailable(f"sandbox {sandbox_id} is unreachable: {exc}") from exc
            except DaemonError as exc:
                raise _daemon_error(exc) from exc
        finally:
            live.in_flight -= 1
            live.last_active = time.monotonic()

    @asynccontextmanager
    async def mcp_operation(self, org_id: str, sandbox_id: str) -> AsyncIterator[tuple[DaemonClient, SandboxHttpBrokers]]:
        """``operation`` plus the sandbox's HTTP MCP brokers."""
        async with self.operation(org_id, sandbox_id) as client:
            yield client, self._require_live(sandbox_id).http_mcp

    async def _reap_idle(self) -> None:
        interval = max(0.05, min(self._idle_pause_s / 4, 10.0))
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for sandbox_id, live in list(self._live.items()):
                if live.paused or live.in_flight or now - live.last_active < self._idle_pause_s:
                    continue
                try:
                    processes = await live.client.list_processes()
                    if any(p.keepalive and p.running for p in processes):
                        live.last_active = now
                        continue
                    async with live.lock:
                        if live.in_flight or live.paused or time.monotonic() - live.last_active < self._idle_pause_s:
                            continue
                        await self._backend.pause(live.handle)
                        live.paused = True
                        # Under the lock, as in pause(): a resume waits for the row to say paused.
                        await self._set_state(sandbox_id, _PAUSABLE, SandboxState.PAUSED)
                    log.info("sandbox_idle_paused", sandbox_id=sandbox_id)
                except Exception as exc:  # one broken sandbox must not stop the reaper
                    log.warning("sandbox_idle_pause_failed", sandbox_id=sandbox_id, error=str(exc))


def _substitution(secret: SecretParams, placeholder: str = "") -> Substitution:
    return Substitution(
        placeholder=placeholder or new_placeholder(),
        value=secret.value,
        any_allowed_host=secret.any_allowed_host,
        allowed_hosts=frozenset(h for h in map(parse_host, secret.allowed_hosts) if h is not None),
        credential_id=secret.credential_id,
    )


def _page_size(requested: int) -> int:
    return requested if 0 < requested <= 1000 else 100


def _network_policy(network: Mapping[str, object]) -> NetworkPolicy:
    access = str(network.get("access") or "enabled")
    return "disabled" if access == "disabled" else ("restricted" if access == "restricted" else "enabled")


def _egress_policy(network: Mapping[str, object]) -> EgressPolicy:
    def strings(value: object) -> list[str]:
        return [str(v) for v in value] if isinstance(value, list | tuple) else []

    return EgressPolicy(strings(network.get("allowed_domains")), strings(network.get("blocked_domains")))


def _stored_handle(handle_json: str) -> BackendHandle | None:
    try:
        return BackendHandle.from_json(handle_json)
    except (ValueError, KeyError, TypeError):
        return None  # "{}": the create never got as far as a handle


def _daemon_error(exc: DaemonError) -> Exception:
    from services.core.errors import BerthError, FailedPrecondition, McpServerDead, PathOutsideWorkspace

    if exc.reason == "mcp_server_dead":
        return McpServerDead(exc.message, param=exc.param)
    mapping: dict[str, type[BerthError]] = {
        "not_found": NotFound,
        "invalid_argument": InvalidArgument,
        "permission_denied": PathOutsideWorkspace,
        "failed_precondition": FailedPrecondition,
    }
    cls = mapping.get(exc.code)
    if cls is None:
        return SandboxUnavailable(f"sandbox daemon error: {exc.message}")
    if exc.param is not None:
        return cls(exc.message, param=exc.param)
    # File operations name no field; their offending field is the path.
    return cls(exc.message, param="path" if cls is not NotFound else None)
