"""Unauthenticated operational endpoints: ``/healthz`` (liveness),
``/readyz`` (readiness), ``/metrics`` and the OpenAPI document.

Liveness is only "the process answers HTTP": restarting a gateway because a
dependency is down would not bring the dependency back. Readiness is what a
balancer routes on: 200 only while the Session and Environment services
answer their gRPC health checks over the gateway's own channels and the
gateway's database answers, 503 otherwise.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from sqlalchemy import text

from gateway.openapi import OPENAPI_PATH, ProbeReport, openapi_document
from gateway.state import StateDep

__all__ = ["router"]

router = APIRouter()

_HEALTH_TIMEOUT_S = 2.0
_SERVING = "SERVING"


async def _grpc_status(stub: health_pb2_grpc.HealthStub) -> str:
    try:
        response = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=_HEALTH_TIMEOUT_S, wait_for_ready=False)
    except grpc.RpcError as exc:
        return str(exc.code().name)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))


async def _database_status(state: StateDep) -> str:
    try:
        async with state.db.engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
    except Exception:
        return "UNAVAILABLE"
    return _SERVING


def _report(checks: dict[str, str]) -> JSONResponse:
    ready = all(value == _SERVING for value in checks.values())
    report = ProbeReport(status="ok" if ready else "unavailable", checks=checks)
    return JSONResponse(report.model_dump(), status_code=200 if ready else 503)


@router.get("/healthz")
async def healthz() -> JSONResponse:
    return _report({})


@router.get("/readyz")
async def readyz(state: StateDep) -> JSONResponse:
    session, environment, database = await asyncio.gather(
        _grpc_status(state.session_health), _grpc_status(state.environment_health), _database_status(state)
    )
    return _report({"session": session, "environment": environment, "database": database})


@router.get("/metrics")
async def metrics() -> Response:
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


@router.get(OPENAPI_PATH)
async def openapi(request: Request) -> JSONResponse:
    document: dict[str, Any] | None = getattr(request.app.state, "openapi_document", None)
    if document is None:
        document = openapi_document(request.app)
        request.app.state.openapi_document = document
    return JSONResponse(document)
