"""Prometheus metrics shared by every process."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

__all__ = [
    "RPC_REQUESTS",
    "RPC_LATENCY",
    "HTTP_REQUESTS",
    "HTTP_LATENCY",
    "ENVIRONMENTS",
    "SANDBOXES",
    "SANDBOX_EGRESS",
    "INIT_DURATION",
    "ORPHAN_SANDBOXES_REAPED",
    "start_metrics_server",
]

RPC_REQUESTS = Counter("berth_rpc_requests_total", "gRPC requests served", ["method", "code"])
RPC_LATENCY = Histogram("berth_rpc_latency_seconds", "gRPC request latency", ["method", "code"])
HTTP_REQUESTS = Counter("berth_http_requests_total", "HTTP requests served", ["method", "route", "status"])
HTTP_LATENCY = Histogram("berth_http_latency_seconds", "HTTP request latency", ["method", "route"])
ENVIRONMENTS = Gauge("berth_environments", "Environments by status", ["status"])
SANDBOXES = Gauge("berth_sandboxes", "Sandboxes by state", ["state"])
SANDBOX_EGRESS = Counter(
    "berth_sandbox_egress_requests_total", "Egress proxy decisions for restricted sandboxes", ["decision", "reason"]
)
INIT_DURATION = Histogram(
    "berth_environment_init_seconds", "Environment setup duration", buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
)
ORPHAN_SANDBOXES_REAPED = Counter(
    "berth_orphan_sandboxes_reaped_total",
    "Sandboxes the Environment service destroyed because their environment no longer exists",
    ["reason"],
)


def start_metrics_server(port: int) -> None:
    """Serves this process's metrics at ``http://0.0.0.0:<port>/metrics``; 0 disables it."""
    if port:
        start_http_server(port)
