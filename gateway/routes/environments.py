"""Environments (``/v1/agents/environments``) and their live files.

Create and delete are Rebyte extensions; retrieve, list and the files
routes are the SDK's. Creation records configuration only and returns 201
with status ``pending``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi import Query, Request
from fastapi.responses import Response

from berth.environment.v1 import environment_service_pb2 as pb
from gateway import render
from gateway.convert import environment_config
from gateway.errors import ApiError
from gateway.idempotency import IdempotencyDep
from gateway.routes._common import v1_router, json_response, read_json, require_id
from gateway.state import EnvironmentStubDep
from gateway.validation import (
    EnvironmentCreateBody,
    EnvironmentFileCreateBody,
    check_hosted_config,
    InlineFile,
    decode_base64,
    validate_body,
    workspace_dir,
)

__all__ = ["router"]

router = v1_router()


@router.post("/agents/environments")
async def create_environment(request: Request, stub: EnvironmentStubDep, idempotency: IdempotencyDep) -> Response:
    body = await read_json(request)
    parsed = validate_body(EnvironmentCreateBody, body.data)
    check_hosted_config(parsed.environment, "environment")
    config = environment_config(parsed.environment)
    async with idempotency.begin(body.hash) as idem:
        if idem.replay is not None:
            return idem.replay.to_response()
        response = await stub.CreateEnvironment(
            pb.CreateEnvironmentRequest(config=config, vault_ids=parsed.vault_ids or [])
        )
        content = render.environment_info(response.environment)
        await idem.store(201, json.dumps(content))
        return json_response(content, 201)


@router.get("/agents/environments")
async def list_environments(
    stub: EnvironmentStubDep,
    after: Annotated[str | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Annotated[Literal["asc", "desc"], Query()] = "desc",
    type: Annotated[Literal["openai_hosted"], Query()] = "openai_hosted",
) -> dict[str, Any]:
    response = await stub.ListEnvironments(pb.ListEnvironmentsRequest(page_size=limit, after=after or "", order=order))
    return render.cursor_page([render.environment_info(e) for e in response.environments], response.has_more)


@router.get("/agents/environments/{environment_id}")
async def retrieve_environment(environment_id: str, stub: EnvironmentStubDep) -> dict[str, Any]:
    response = await stub.GetEnvironment(pb.GetEnvironmentRequest(environment_id=require_id(environment_id, "env")))
    return render.environment_info(response.environment)


@router.delete("/agents/environments/{environment_id}")
async def delete_environment(environment_id: str, stub: EnvironmentStubDep) -> dict[str, Any]:
    response = await stub.DeleteEnvironment(
        pb.DeleteEnvironmentRequest(environment_id=require_id(environment_id, "env"))
    )
    return render.deleted(response.environment_id or environment_id, "agent.environment.deleted")


@router.post("/agents/environments/{environment_id}/files")
async def create_environment_file(
    environment_id: str, request: Request, stub: EnvironmentStubDep, idempotency: IdempotencyDep
) -> Response:
    require_id(environment_id, "env")
    body = await read_json(request)
    parsed = validate_body(EnvironmentFileCreateBody, body.data).root
    if isinstance(parsed, InlineFile):
        req = pb.CreateEnvironmentFileRequest(
            environment_id=environment_id, path=parsed.path, data=decode_base64(parsed.data)
        )
    else:
        req = pb.CreateEnvironmentFileRequest(environment_id=environment_id, path=parsed.path, file_id=parsed.file_id)
    async with idempotency.begin(body.hash) as idem:
        if idem.replay is not None:
            return idem.replay.to_response()
        response = await stub.CreateEnvironmentFile(req)
        content = render.registered_file(response.file)
        await idem.store(200, json.dumps(content))
        return json_response(content)


@router.get("/agents/environments/{environment_id}/files")
async def list_environment_files(
    environment_id: str,
    stub: EnvironmentStubDep,
    limit: Annotated[int | None, Query(ge=1, le=100)] = None,
    order: Annotated[Literal["asc", "desc"], Query()] = "desc",
    page: Annotated[str | None, Query()] = None,
    path: Annotated[str | None, Query()] = None,
) -> dict[str, Any]:
    require_id(environment_id, "env")
    directory = ""
    if path:
        try:
            directory = workspace_dir(path)
        except ValueError as exc:
            raise ApiError(400, "validation_error", str(exc), param="path") from exc
    response = await stub.ListEnvironmentFiles(
        pb.ListEnvironmentFilesRequest(
            environment_id=environment_id,
            path=directory,
            order=order,
            page_size=limit or 0,
            page_token=page or "",
        )
    )
    data = [render.registered_file(f) for f in response.files]
    return {
        "object": "list",
        "data": data,
        "has_more": bool(response.next_page_token),
        "next": response.next_page_token or None,
    }
