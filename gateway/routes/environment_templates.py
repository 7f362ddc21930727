"""Environment templates (``/v1/agents/environments/templates``), the SDK's
``client.beta.agents.environments.templates``.

Registered before the environments routes, so ``templates`` is never read
as an environment ID. The override rules of environments created from a
template live in ``services/environment/templates.py``.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from berth.environment.v1 import environment_service_pb2 as pb
from gateway import render
from gateway.convert import template_request, update_template_request
from gateway.idempotency import Idempotency, IdempotencyDep
from gateway.routes._common import PageDep, json_response, read_json, require_id, v1_router
from gateway.state import EnvironmentStubDep
from gateway.validation import TemplateBody, check_hosted_config, validate_body

__all__ = ["router"]

router = v1_router()

_PREFIX = "envtpl"


async def _body(request: Request) -> tuple[TemplateBody, str]:
    body = await read_json(request)
    parsed = validate_body(TemplateBody, body.data)
    check_hosted_config(parsed, "")
    return parsed, body.hash


async def _stored_once(idempotency: Idempotency, body_hash: str, call: Callable[[], Awaitable[Any]]) -> Response:
    """The template a create or update returns, replayed for a repeated
    ``Idempotency-Key`` (``call`` is made only when nothing is replayed)."""
    async with idempotency.begin(body_hash) as idem:
        if idem.replay is not None:
            return idem.replay.to_response()
        response = await call()
        content = render.environment_template(response.template)
        await idem.store(200, json.dumps(content))
        return json_response(content)


@router.post("/agents/environments/templates")
async def create_template(request: Request, stub: EnvironmentStubDep, idempotency: IdempotencyDep) -> Response:
    parsed, body_hash = await _body(request)
    return await _stored_once(idempotency, body_hash, lambda: stub.CreateEnvironmentTemplate(template_request(parsed)))


@router.get("/agents/environments/templates")
async def list_templates(stub: EnvironmentStubDep, page: PageDep) -> dict[str, Any]:
    response = await stub.ListEnvironmentTemplates(
        pb.ListEnvironmentTemplatesRequest(page_size=page.limit, after=page.after, order=page.order)
    )
    return render.cursor_page([render.environment_template(t) for t in response.templates], response.has_more)


@router.get("/agents/environments/templates/{environment_template_id}")
async def retrieve_template(environment_template_id: str, stub: EnvironmentStubDep) -> dict[str, Any]:
    response = await stub.GetEnvironmentTemplate(
        pb.GetEnvironmentTemplateRequest(template_id=require_id(environment_template_id, _PREFIX))
    )
    return render.environment_template(response.template)


@router.post("/agents/environments/templates/{environment_template_id}")
async def update_template(
    environment_template_id: str, request: Request, stub: EnvironmentStubDep, idempotency: IdempotencyDep
) -> Response:
    require_id(environment_template_id, _PREFIX)
    parsed, body_hash = await _body(request)
    message = update_template_request(environment_template_id, parsed)
    return await _stored_once(idempotency, body_hash, lambda: stub.UpdateEnvironmentTemplate(message))


@router.delete("/agents/environments/templates/{environment_template_id}")
async def delete_template(environment_template_id: str, stub: EnvironmentStubDep) -> dict[str, Any]:
    response = await stub.DeleteEnvironmentTemplate(
        pb.DeleteEnvironmentTemplateRequest(template_id=require_id(environment_template_id, _PREFIX))
    )
    return render.deleted(response.template_id or environment_template_id, "agent.environment.template.deleted")
