"""Composition root of the Sandbox service."""

from __future__ import annotations

from pathlib import Path

import grpc

from berth.sandbox.v1 import sandbox_service_pb2, sandbox_service_pb2_grpc
from services.core.context import internal_token
from services.core.db import open_database
from services.core.grpc_server import start_grpc_server
from services.core.interceptors import allowed_callers
from services.core.key_ring import KeyRing
from services.core.logging import get_logger
from services.core.service import ServiceHandle
from services.core.settings import Settings
from services.sandbox.backends.base import SandboxBackend, proxy_env
from services.sandbox.egress import EgressOptions, EgressProxies
from services.sandbox.egress_ca import EgressCA
from services.sandbox.egress_substitution import Interceptor
from services.sandbox.manager import SandboxManager
from services.sandbox.servicer import SandboxServicer

__all__ = ["start_sandbox_service", "build_backend", "egress_ca", "SANDBOX_CALLERS"]

log = get_logger(__name__)

_MIGRATIONS = Path(__file__).parent / "migrations" / "versions"
_SERVICE = sandbox_service_pb2.DESCRIPTOR.services_by_name["SandboxService"]

# Only the Environment service drives sandboxes; that includes the
# cross-organization inventory (ListLabeledSandboxes, CountSandboxes).
SANDBOX_CALLERS = allowed_callers(_SERVICE, {"environment": [method.name for method in _SERVICE.methods]})


def egress_ca(settings: Settings) -> EgressCA:
    """The CA of this node's egress proxies (made on first use)."""
    return EgressCA(settings.data_dir.resolve() / "egress-ca")


def _configured_ca_bundle(settings: Settings) -> Path | None:
    return Path(settings.sandbox_ca_bundle) if settings.sandbox_ca_bundle.strip() else None


def _sandbox_ca_bundle(settings: Settings) -> Path:
    """What sandboxes trust: the configured bundle (default the host's) plus
    the egress CA, so TLS that the egress proxy terminates to substitute a
    secret verifies inside."""
    base = _configured_ca_bundle(settings) or Path("/etc/ssl/certs/ca-certificates.crt")
    if settings.sandbox_ca_bundle.strip() and not base.is_file():
        # As before: the backend reports an unreadable configured bundle.
        return base
    return egress_ca(settings).bundle_with(base)


def build_backend(settings: Settings) -> tuple[SandboxBackend, str, str]:
    """Returns (backend, backend name, isolation)."""
    if settings.sandbox_backend == "docker":
        from services.sandbox.backends.docker import DockerBackend

        trusting = settings.model_copy(update={"sandbox_ca_bundle": str(_sandbox_ca_bundle(settings))})
        return DockerBackend(trusting), "docker", "docker"
    from services.sandbox.backends.local import LocalBackend

    extra_env = _proxy_env(settings)
    backend = LocalBackend(
        settings.data_dir.resolve(),
        settings.sandbox_isolation,
        extra_env=extra_env,
        extra_ro_mounts=dict(settings.sandbox_extra_ro_mounts.items()),
        allow_cidrs=settings.sandbox_allow_cidrs,
        ca_bundle=_sandbox_ca_bundle(settings),
        dormant_after_s=settings.sandbox_dormant_after_s,
        pool_size=settings.sandbox_pool_size,
    )
    if settings.sandbox_isolation == "none":
        log.warning("sandbox_isolation_disabled", detail="BERTH_SANDBOX_ISOLATION=none: sandboxes run unconfined on this host")
    return backend, "local", settings.sandbox_isolation


def _proxy_env(settings: Settings) -> dict[str, str]:
    return proxy_env(settings.sandbox_http_proxy, settings.sandbox_https_proxy, settings.sandbox_no_proxy)


async def start_sandbox_service(settings: Settings, *, address: str | None = None) -> ServiceHandle:
    token = internal_token(settings)
    backend, name, isolation = build_backend(settings)
    db = await open_database(settings.database_url("sandbox"), "sandbox", _MIGRATIONS, pool=settings.database_pool())
    manager = SandboxManager(
        db,
        backend,
        backend_name=name,
        isolation=isolation,
        idle_pause_s=settings.sandbox_idle_pause_s,
        egress=EgressProxies(
            EgressOptions.from_settings(settings),
            interceptor=Interceptor(egress_ca(settings), _configured_ca_bundle(settings)),
        ),
        mcp_ca_bundle=_configured_ca_bundle(settings),
        secret_keys=KeyRing.load(
            settings.sandbox_secret_keys.get_secret_value(), None, settings.data_dir / "sandbox-secrets.keys"
        ),
    )
    await manager.start()
    # After adopt, which removes what an earlier process's pool left behind.
    await backend.start()

    def register(server: grpc.aio.Server) -> list[str]:
        sandbox_service_pb2_grpc.add_SandboxServiceServicer_to_server(SandboxServicer(manager), server)
        return [_SERVICE.full_name]

    running = await start_grpc_server(address or settings.sandbox_addr, register, token=token, callers=SANDBOX_CALLERS)
    return ServiceHandle(name="sandbox", grpc=running, closers=[db.dispose, backend.close, manager.close])
