"""gRPC server bootstrap: interceptors, health, reflection, graceful stop,
and the one way to open a channel to another Berth service."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import grpc
from google.protobuf import descriptor_pool
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.core.context import PeerCredentials
from services.core.grpc_client import DomainErrorInterceptors, ReadyWaitInterceptors, service_config
from services.core.interceptors import CallerTable, ClientContextInterceptors, ServerContextInterceptor, undeclared_methods
from services.core.logging import get_logger

__all__ = ["RunningServer", "start_grpc_server", "open_channel", "wait_for_termination_signal", "MAX_MESSAGE_BYTES"]

log = get_logger("berth.grpc")

MAX_MESSAGE_BYTES = 80 * 1024 * 1024

_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # A restarted peer is found again within a second, not after the default
    # exponential backoff of up to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

@dataclass
class RunningServer:
    server: grpc.aio.Server
    # The bound TCP port; 1 for a ``unix:`` address, whose path is the address.
    port: int
    health: health.aio.HealthServicer
    service_names: list[str] = field(default_factory=list)

    async def stop(self, grace: float) -> None:
        for name in [*self.service_names, ""]:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(grace)


async def start_grpc_server(
    address: str,
    register: Callable[[grpc.aio.Server], Iterable[str]],
    *,
    token: str,
    callers: CallerTable,
) -> RunningServer:
    """Starts a server on ``address``: ``host:port`` (port 0 picks a free one)
    or ``unix:/absolute/path``. ``register`` adds the servicers and returns
    their full service names. Every call but health checks must carry
    ``token``, and a peer ``callers`` names for its method."""
    server = grpc.aio.server(
        interceptors=[ServerContextInterceptor(token=token, callers=callers)],
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
            # Clients ping idle connections every 30 s (see _CHANNEL_OPTIONS);
            # accept that instead of answering GOAWAY "too_many_pings".
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
            ("grpc.http2.max_ping_strikes", 0),
        ],
    )
    names = list(register(server))
    pool = descriptor_pool.Default()
    undeclared = undeclared_methods([pool.FindServiceByName(name) for name in names], callers)
    if undeclared:
        raise ValueError(f"no peer may call {', '.join(undeclared)}: declare their callers in the service's table")
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*names, reflection.SERVICE_NAME, health.SERVICE_NAME], server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"cannot bind {address}")
    await server.start()
    for name in [*names, ""]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("grpc_server_started", address=address, port=port, services=names)
    return RunningServer(server=server, port=port, health=health_servicer, service_names=names)


def open_channel(
    address: str,
    *,
    timeout_s: float,
    credentials: PeerCredentials | None,
    services: Iterable[ServiceDescriptor] = (),
    domain_errors: bool = False,
    ready_wait_s: float | None = None,
    interceptors: Iterable[grpc.aio.ClientInterceptor] = (),
) -> grpc.aio.Channel:
    """A channel that attaches ``credentials`` to every call, propagates
    request context, sets deadlines and retries UNAVAILABLE on the methods of
    ``services`` their protos mark idempotent. With ``domain_errors`` a failed
    call raises its domain error (how services call each other); without, the
    ``grpc.aio.AioRpcError`` (the gateway maps those to HTTP itself). With
    ``ready_wait_s`` (seconds; 0 or None: no wait) a call waits that long for
    a connection before it fails (``PeerUnreachable``) instead of failing at
    once while the service is down. ``interceptors`` go first, so they see each call's final outcome.
    Without credentials only health checks answer."""
    options: list[tuple[str, str | int]] = [
        *_CHANNEL_OPTIONS,
        ("grpc.enable_retries", 1),
        ("grpc.service_config", service_config(services)),
    ]
    waits = ReadyWaitInterceptors(ready_wait_s) if ready_wait_s else []
    chain = [
        *interceptors,
        *(DomainErrorInterceptors() if domain_errors else ()),
        *ClientContextInterceptors(timeout_s, credentials),
        *waits,
    ]
    channel = grpc.aio.insecure_channel(address, options=options, interceptors=chain)
    for wait in waits:
        wait.channel, wait.target = channel, address
    return channel


async def wait_for_termination_signal(lifeline_fd: int | None = None) -> None:
    """Returns on SIGTERM or SIGINT, or once ``lifeline_fd`` (a pipe's read
    end whose writer is the process's supervisor) reads EOF: the supervisor
    is gone."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if lifeline_fd is not None:
        # Nothing this process starts (a sandbox) inherits it.
        os.set_inheritable(lifeline_fd, False)
        loop.add_reader(lifeline_fd, stop.set)
    await stop.wait()
    if lifeline_fd is not None:
        loop.remove_reader(lifeline_fd)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)
