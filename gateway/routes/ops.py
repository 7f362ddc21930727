"""Unauthenticated operational endpoints: ``/healthz`` and ``/metrics``."""

from __future__ import annotations

import asyncio

import grpc
from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from sqlalchemy import text

from gateway.state import StateDep

__all__ = ["router"]

router = APIRouter()

_HEALTH_TIMEOUT_S = 2.0


async def _grpc_status(stub: health_pb2_grpc.HealthStub) -> str:
    try:
        response = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=_HEALTH_TIMEOUT_S)
    except grpc.RpcError as exc:
        return str(exc.code().name)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))


async def _database_status(state: StateDep) -> str:
    try:
        async with state.db.engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
    except Exception:
        return "UNAVAILABLE"
    return "SERVING"


@router.get("/healthz")
async def healthz(state: StateDep) -> JSONResponse:
    session, environment, database = await asyncio.gather(
        _grpc_status(state.session_health), _grpc_status(state.environment_health), _database_status(state)
    )
    checks = {"session": session, "environment": environment, "database": database}
    healthy = all(value == "SERVING" for value in checks.values())
    return JSONResponse({"status": "ok" if healthy else "unavailable", "checks": checks}, status_code=200 if healthy else 503)


@router.get("/metrics")
async def metrics() -> Response:
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)
