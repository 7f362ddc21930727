"""The gateway's OpenAPI 3.1 document, served at ``GET /v1/openapi.json``.

Nothing in it is written twice. FastAPI reads the path, query and header
parameters from the route signatures; request bodies are the JSON schemas of
the strict models in ``gateway.validation`` that the routes validate with;
response bodies are the JSON schemas of the official ``openai`` SDK's types
(the models ``client.beta.agents`` parses with), plus the few Berth
extensions below. ``OPERATIONS`` says which model belongs to which route, and
building the document fails on a route it does not cover.

Stateful links are derived from the route table: a create (``POST`` on a
collection) or a list (``GET`` on it) yields the ID of its members, and
links to every operation that takes that ID in its path.

The document describes the public API, not any tenant's data, so it is
served without authentication, like ``/healthz``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, get_args

import pydantic
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute, RouteContext, iter_route_contexts
from openai.pagination import SyncConversationCursorPage, SyncCursorPage, SyncTokenPage
from openai.types.beta.agent import Agent
from openai.types.beta.agent_deleted import AgentDeleted
from openai.types.beta.agent_session import AgentSession
from openai.types.beta.agent_session_deleted import AgentSessionDeleted
from openai.types.beta.agent_session_event import AgentSessionEvent
from openai.types.beta.agent_session_item import AgentSessionItem
from openai.types.beta.agents.automation import Automation
from openai.types.beta.agents.automation_deleted import AutomationDeleted
from openai.types.beta.agents.automations.automation_invocation import AutomationInvocation
from openai.types.beta.agents.environment_info import EnvironmentInfo
from openai.types.beta.agents.environments.environment_file import EnvironmentFile
from openai.types.beta.agents.environments.environment_template import EnvironmentTemplate
from openai.types.beta.agents.environments.environment_template_deleted import EnvironmentTemplateDeleted
from openai.types.beta.agents.sessions.session_artifact import SessionArtifact
from openai.types.beta.agents.sessions.session_artifact_deleted import SessionArtifactDeleted
from openai.types.beta.agents.sessions.session_trace import SessionTrace
from openai.types.beta.agents.sessions.turn import Turn
from openai.types.beta.agents.vault import Vault
from openai.types.beta.agents.vault_deleted import VaultDeleted
from openai.types.beta.agents.vaults.credential import Credential
from openai.types.beta.agents.vaults.credential_deleted import CredentialDeleted
from openai.types.beta.subagent import Subagent
from openai.types.file_deleted import FileDeleted
from openai.types.file_object import FileObject
from openai.types.shared.error_object import ErrorObject
from openai.types.webhooks.deleted_webhook_endpoint import DeletedWebhookEndpoint
from openai.types.webhooks.webhook_endpoint import WebhookEndpoint
from openai.types.webhooks.webhook_endpoint_with_secret import WebhookEndpointWithSecret
from openai.types.webhooks.webhook_event_type_list import WebhookEventTypeList

from gateway.automation_requests import AutomationCreateBody, AutomationUpdateBody
from gateway.auth import BETA_HEADER_VALUE, authorize, requires_beta_header
from gateway.idempotency import IDEMPOTENCY_HEADER, IdempotencyDep
from gateway.vault_validation import CredentialCreateBody, CredentialUpdateBody, VaultCreateBody, VaultUpdateBody
from gateway.validation import (
    AgentCreateBody,
    AgentUpdateBody,
    EnvironmentCreateBody,
    EnvironmentFileCreateBody,
    EventsCreateBody,
    SessionCreateBody,
    TemplateBody,
    SessionUpdateBody,
    WebhookEndpointCreateBody,
    WebhookEndpointUpdateBody,
    WebhookRotateSecretBody,
)

__all__ = [
    "OPENAPI_PATH",
    "Operation",
    "OPERATIONS",
    "EnvironmentDeleted",
    "WebhookDelivery",
    "ErrorResponse",
    "ProbeReport",
    "FileUploadForm",
    "openapi_document",
]

OPENAPI_PATH = "/v1/openapi.json"
_REF = "#/components/schemas/{model}"


class EnvironmentDeleted(pydantic.BaseModel):
    """Deleting an environment: a Berth route the SDK has no model for, in
    the SDK's deleted-object shape."""

    model_config = pydantic.ConfigDict(extra="forbid")

    id: str
    object: Literal["agent.environment.deleted"]
    deleted: Literal[True]


class WebhookDeliveryAttempt(pydantic.BaseModel):
    """One attempt of a webhook delivery (a Berth extension)."""

    attempt: int
    started_at: int
    duration_ms: float
    status_code: int | None
    error: str | None
    success: bool


class WebhookDelivery(pydantic.BaseModel):
    """``GET /v1/webhook_endpoints/{id}/deliveries``: one event for one
    endpoint from the outbox, with its attempts (a Berth extension)."""

    id: str
    object: Literal["webhook_endpoint.delivery"]
    webhook_endpoint_id: str
    event_id: str = pydantic.Field(description="Sent as webhook-id on every attempt.")
    event_type: str
    status: Literal["pending", "delivered", "failed"]
    attempt_count: int
    created_at: int
    next_attempt_at: int | None
    delivered_at: int | None
    attempts: list[WebhookDeliveryAttempt]


class ErrorResponse(pydantic.BaseModel):
    """The OpenAI error envelope every failure uses (``gateway.errors``)."""

    error: ErrorObject


class ProbeReport(pydantic.BaseModel):
    """The body of ``/healthz`` and ``/readyz``."""

    status: Literal["ok", "unavailable"]
    checks: dict[str, str] = pydantic.Field(
        default_factory=dict, description="Dependency -> gRPC health status name (SERVING, UNAVAILABLE...)."
    )


class FileUploadForm(pydantic.BaseModel):
    """``POST /v1/files`` (multipart): what ``gateway.routes.files`` reads."""

    file: bytes
    purpose: str = pydantic.Field(description="One of FILE_PURPOSES (the enum below).")
    expires_after_anchor: Literal["created_at"] | None = pydantic.Field(default=None, alias="expires_after[anchor]")
    expires_after_seconds: int | None = pydantic.Field(default=None, alias="expires_after[seconds]")


Body = Literal["json", "sse", "json_or_sse", "bytes", "empty", "text"]


@dataclass(frozen=True)
class Operation:
    """What one route takes and returns, by model."""

    summary: str
    response: Any = None
    request: Any = None
    status: int = 200
    body: Body = "json"
    request_media: str = "application/json"


# Every route of the gateway -> its models. ``response`` is the SDK type of a
# JSON body (or of each SSE ``data:`` frame).
OPERATIONS: dict[tuple[str, str], Operation] = {
    ("POST", "/v1/agents"): Operation("Create an agent", Agent, AgentCreateBody),
    ("GET", "/v1/agents"): Operation("List agents", SyncCursorPage[Agent]),
    ("GET", "/v1/agents/{agent_id}"): Operation("Retrieve an agent", Agent),
    ("POST", "/v1/agents/{agent_id}"): Operation("Update an agent", Agent, AgentUpdateBody),
    ("DELETE", "/v1/agents/{agent_id}"): Operation("Delete an agent", AgentDeleted),
    ("POST", "/v1/agents/environments"): Operation(
        "Create an environment (configuration only: status pending)", EnvironmentInfo, EnvironmentCreateBody, status=201
    ),
    ("GET", "/v1/agents/environments"): Operation("List environments", SyncCursorPage[EnvironmentInfo]),
    ("GET", "/v1/agents/environments/{environment_id}"): Operation("Retrieve an environment", EnvironmentInfo),
    ("DELETE", "/v1/agents/environments/{environment_id}"): Operation("Delete an environment", EnvironmentDeleted),
    ("POST", "/v1/agents/environments/{environment_id}/files"): Operation(
        "Add a file to an environment", EnvironmentFile, EnvironmentFileCreateBody
    ),
    ("GET", "/v1/agents/environments/{environment_id}/files"): Operation(
        "List an environment's files", SyncTokenPage[EnvironmentFile]
    ),
    ("POST", "/v1/agents/environments/templates"): Operation(
        "Create an environment template", EnvironmentTemplate, TemplateBody
    ),
    ("GET", "/v1/agents/environments/templates"): Operation(
        "List environment templates", SyncCursorPage[EnvironmentTemplate]
    ),
    ("GET", "/v1/agents/environments/templates/{environment_template_id}"): Operation(
        "Retrieve an environment template", EnvironmentTemplate
    ),
    ("POST", "/v1/agents/environments/templates/{environment_template_id}"): Operation(
        "Update an environment template (omitted fields kept, null resets)", EnvironmentTemplate, TemplateBody
    ),
    ("DELETE", "/v1/agents/environments/templates/{environment_template_id}"): Operation(
        "Delete an environment template", EnvironmentTemplateDeleted
    ),
    ("POST", "/v1/files"): Operation("Upload a file", FileObject, FileUploadForm, request_media="multipart/form-data"),
    ("GET", "/v1/files"): Operation("List files", SyncCursorPage[FileObject]),
    ("GET", "/v1/files/{file_id}"): Operation("Retrieve a file", FileObject),
    ("GET", "/v1/files/{file_id}/content"): Operation("Download a file's content", body="bytes"),
    ("DELETE", "/v1/files/{file_id}"): Operation("Delete a file", FileDeleted),
    ("POST", "/v1/agents/sessions"): Operation(
        "Create a session (with stream: true, its event stream)", AgentSession, SessionCreateBody, body="json_or_sse"
    ),
    ("GET", "/v1/agents/sessions"): Operation("List sessions", SyncCursorPage[AgentSession]),
    ("GET", "/v1/agents/sessions/{session_id}"): Operation("Retrieve a session", AgentSession),
    ("POST", "/v1/agents/sessions/{session_id}"): Operation("Update a session", AgentSession, SessionUpdateBody),
    ("DELETE", "/v1/agents/sessions/{session_id}"): Operation("Delete a session", AgentSessionDeleted),
    ("POST", "/v1/agents/sessions/{session_id}/events"): Operation(
        "Submit input events", request=EventsCreateBody, status=202, body="empty"
    ),
    ("GET", "/v1/agents/sessions/{session_id}/events"): Operation(
        "Subscribe to a session's events (a live stream)", AgentSessionEvent, body="sse"
    ),
    ("GET", "/v1/agents/sessions/{session_id}/turns"): Operation("List turns", SyncCursorPage[Turn]),
    ("GET", "/v1/agents/sessions/{session_id}/turns/{turn_id}"): Operation("Retrieve a turn", Turn),
    ("GET", "/v1/agents/sessions/{session_id}/items"): Operation(
        "List a session's items", SyncCursorPage[AgentSessionItem]
    ),
    ("GET", "/v1/agents/sessions/{session_id}/turns/{turn_id}/items"): Operation(
        "List a turn's items", SyncConversationCursorPage[AgentSessionItem]
    ),
    ("GET", "/v1/agents/sessions/{session_id}/subagents"): Operation("List subagents", SyncCursorPage[Subagent]),
    ("GET", "/v1/agents/sessions/{session_id}/subagents/{subagent_id}"): Operation("Retrieve a subagent", Subagent),
    ("GET", "/v1/agents/sessions/{session_id}/subagents/{subagent_id}/items"): Operation(
        "List a subagent's items", SyncCursorPage[AgentSessionItem]
    ),
    ("GET", "/v1/agents/sessions/{session_id}/subagents/{subagent_id}/turns"): Operation(
        "List a subagent's turns", SyncCursorPage[Turn]
    ),
    ("GET", "/v1/agents/sessions/{session_id}/subagents/{subagent_id}/turns/{turn_id}"): Operation(
        "Retrieve a subagent's turn", Turn
    ),
    ("GET", "/v1/agents/sessions/{session_id}/subagents/{subagent_id}/turns/{turn_id}/items"): Operation(
        "List a subagent turn's items", SyncCursorPage[AgentSessionItem]
    ),
    ("GET", "/v1/agents/sessions/{session_id}/traces"): Operation(
        "List the traces of a session's root turns", SyncCursorPage[SessionTrace]
    ),
    ("GET", "/v1/agents/sessions/{session_id}/artifacts"): Operation("List artifacts", SyncCursorPage[SessionArtifact]),
    ("GET", "/v1/agents/sessions/{session_id}/artifacts/{artifact_id}"): Operation(
        "Retrieve an artifact", SessionArtifact
    ),
    ("GET", "/v1/agents/sessions/{session_id}/artifacts/{artifact_id}/content"): Operation(
        "Download an artifact's content", body="bytes"
    ),
    ("DELETE", "/v1/agents/sessions/{session_id}/artifacts/{artifact_id}"): Operation(
        "Delete an artifact", SessionArtifactDeleted
    ),
    ("POST", "/v1/vaults"): Operation("Create a vault", Vault, VaultCreateBody),
    ("GET", "/v1/vaults"): Operation("List vaults", SyncCursorPage[Vault]),
    ("GET", "/v1/vaults/{vault_id}"): Operation("Retrieve a vault", Vault),
    ("POST", "/v1/vaults/{vault_id}"): Operation("Update a vault", Vault, VaultUpdateBody),
    ("DELETE", "/v1/vaults/{vault_id}"): Operation("Delete a vault and its credentials", VaultDeleted),
    ("POST", "/v1/vaults/{vault_id}/credentials"): Operation(
        "Store a credential (its secret is write-only)", Credential, CredentialCreateBody
    ),
    ("GET", "/v1/vaults/{vault_id}/credentials"): Operation("List a vault's credentials", SyncCursorPage[Credential]),
    ("GET", "/v1/vaults/{vault_id}/credentials/{credential_id}"): Operation("Retrieve a credential", Credential),
    ("POST", "/v1/vaults/{vault_id}/credentials/{credential_id}"): Operation(
        "Update a credential's metadata or rotate its secret", Credential, CredentialUpdateBody
    ),
    ("DELETE", "/v1/vaults/{vault_id}/credentials/{credential_id}"): Operation(
        "Delete a credential", CredentialDeleted
    ),
    ("POST", "/v1/webhook_endpoints"): Operation(
        "Create a webhook endpoint (its signing secret is returned this once)",
        WebhookEndpointWithSecret,
        WebhookEndpointCreateBody,
    ),
    ("GET", "/v1/webhook_endpoints"): Operation("List webhook endpoints", SyncCursorPage[WebhookEndpoint]),
    ("GET", "/v1/webhook_endpoints/{webhook_endpoint_id}"): Operation("Retrieve a webhook endpoint", WebhookEndpoint),
    ("POST", "/v1/webhook_endpoints/{webhook_endpoint_id}"): Operation(
        "Update a webhook endpoint", WebhookEndpoint, WebhookEndpointUpdateBody
    ),
    ("DELETE", "/v1/webhook_endpoints/{webhook_endpoint_id}"): Operation(
        "Delete a webhook endpoint", DeletedWebhookEndpoint
    ),
    ("POST", "/v1/webhook_endpoints/{webhook_endpoint_id}/rotate_secret"): Operation(
        "Rotate a webhook endpoint's signing secret", WebhookEndpointWithSecret, WebhookRotateSecretBody
    ),
    ("GET", "/v1/webhook_endpoints/{webhook_endpoint_id}/deliveries"): Operation(
        "List a webhook endpoint's deliveries and their attempts", SyncCursorPage[WebhookDelivery]
    ),
    ("GET", "/v1/webhook_event_types"): Operation("List webhook event types", WebhookEventTypeList),
    ("POST", "/v1/agents/automations"): Operation("Create an automation", Automation, AutomationCreateBody),
    ("GET", "/v1/agents/automations"): Operation("List automations", SyncCursorPage[Automation]),
    ("GET", "/v1/agents/automations/{automation_id}"): Operation("Retrieve an automation", Automation),
    ("POST", "/v1/agents/automations/{automation_id}"): Operation(
        "Update an automation", Automation, AutomationUpdateBody
    ),
    ("DELETE", "/v1/agents/automations/{automation_id}"): Operation("Delete an automation", AutomationDeleted),
    ("POST", "/v1/agents/automations/{automation_id}/pause"): Operation("Pause an automation", Automation),
    ("POST", "/v1/agents/automations/{automation_id}/resume"): Operation("Resume an automation", Automation),
    ("POST", "/v1/agents/automations/{automation_id}/invocations"): Operation(
        "Queue a manual invocation", AutomationInvocation
    ),
    ("GET", "/v1/agents/automations/{automation_id}/invocations"): Operation(
        "List an automation's invocations", SyncCursorPage[AutomationInvocation]
    ),
    ("GET", "/v1/agents/automations/{automation_id}/invocations/{invocation_id}"): Operation(
        "Retrieve an invocation", AutomationInvocation
    ),
    ("GET", "/healthz"): Operation("Liveness: the gateway process answers", ProbeReport),
    ("GET", "/readyz"): Operation(
        "Readiness: the Session and Environment services answer (503 otherwise)", ProbeReport
    ),
    ("GET", "/metrics"): Operation("Prometheus metrics", body="text"),
    ("GET", OPENAPI_PATH): Operation("This document"),
}

# The OpenAI list envelope, which the SDK's page classes do not declare.
_PAGE_ENVELOPE: dict[str, Any] = {
    "object": {"const": "list", "type": "string"},
    "first_id": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    "last_id": {"anyOf": [{"type": "string"}, {"type": "null"}]},
}

_PAGE_NAMES = {SyncCursorPage: "Page", SyncTokenPage: "TokenPage", SyncConversationCursorPage: "ConversationPage"}
_ERROR_STATUSES = {
    "400": "Invalid request: a malformed body, an invalid parameter or a missing OpenAI-Beta header",
    "401": "Missing or invalid API key",
    "403": "The API key lacks the scope (tasks:read for GET, tasks:write otherwise)",
    "404": "No such object, or it belongs to another organization",
}


def _component_name(model: Any) -> str:
    """Readable names for generic pages and the item and event unions."""
    if model is AgentSessionItem:
        return "AgentSessionItem"
    if model is AgentSessionEvent:
        return "AgentSessionEvent"
    if model is Automation:
        return "Automation"
    origin = _page_origin(model)
    if origin is not None:
        (item,) = model.__pydantic_generic_metadata__["args"]
        return f"{_component_name(item)}{_PAGE_NAMES[origin]}"
    return str(getattr(model, "__name__", model))


def _page_origin(model: Any) -> Any:
    """The SDK page class ``model`` parametrizes, if it is a page."""
    origin = getattr(model, "__pydantic_generic_metadata__", {}).get("origin")
    return origin if origin in _PAGE_NAMES else None


def _schemas(models: Iterable[Any]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """One schema generation for all models, so shared types are one component.
    Returns model name -> ``$ref`` and the components."""
    unique = {_component_name(m): m for m in models}
    inputs = [(name, "validation", pydantic.TypeAdapter(model)) for name, model in unique.items()]
    refs, defs = pydantic.TypeAdapter.json_schemas(inputs, ref_template=_REF)  # type: ignore[arg-type]
    components: dict[str, Any] = dict(defs.get("$defs", {}))
    by_name: dict[str, dict[str, Any]] = {}
    renames: dict[str, str] = {}
    for (name, _), schema in refs.items():
        ref = schema.get("$ref")
        if ref is None:  # a union without a component of its own
            components[name] = schema
        elif ref != _REF.format(model=name):
            renames[ref.rsplit("/", 1)[1]] = name
        by_name[name] = {"$ref": _REF.format(model=name)}
    for old, new in renames.items():
        components[new] = components.pop(old)
    text = json.dumps(components)
    for old, new in renames.items():
        text = text.replace(json.dumps(_REF.format(model=old)), json.dumps(_REF.format(model=new)))
    components = json.loads(text)
    for name, model in unique.items():
        if _page_origin(model) is not None:
            components[name]["properties"] = {**_PAGE_ENVELOPE, **components[name]["properties"]}
    return by_name, components


def _json(ref: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": ref}}


def _success(op: Operation, refs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    response: dict[str, Any] = {"description": op.summary}
    schema = refs.get(_component_name(op.response)) if op.response is not None else None
    # OpenAPI 3.1 has no itemSchema (3.2 does): the schema of an event stream
    # describes one event, whose data is JSON of the SDK's event union.
    sse = {
        "text/event-stream": {
            "schema": {
                "type": "object",
                "required": ["data"],
                "properties": {
                    "id": {"type": "string", "description": "The event's sequence number (for Last-Event-ID)."},
                    "event": {"type": "string", "description": "The event's type."},
                    "data": {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": refs[_component_name(AgentSessionEvent)],
                    },
                },
            }
        }
    }
    if op.body == "json":
        response["content"] = _json(schema if schema is not None else {"type": "object"})
    elif op.body == "json_or_sse":
        assert schema is not None
        response["content"] = {**_json(schema), **sse}
    elif op.body == "sse":
        response["content"] = sse
    elif op.body == "bytes":
        response["content"] = {"*/*": {"schema": {"type": "string", "contentMediaType": "application/octet-stream"}}}
    elif op.body == "text":
        response["content"] = {"text/plain": {"schema": {"type": "string"}}}
    return response


def _request_body(op: Operation, refs: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    if op.request is None:
        return None
    schema = refs[_component_name(op.request)]
    return {"required": op.request_media != "application/json", "content": {op.request_media: {"schema": schema}}}


def _links(routes: list[tuple[str, str, str]]) -> dict[tuple[str, str], dict[str, Any]]:
    """(method, path) -> the OpenAPI links of its success response."""
    operation_ids = {(m, p): name for m, p, name in routes}
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for method, path, _ in routes:
        if method not in ("POST", "GET") or path.endswith("}"):
            continue
        members = {p for m, p, _ in routes if re.fullmatch(re.escape(path) + r"/\{(\w+)\}", p)}
        if len(members) != 1 or OPERATIONS[(method, path)].body not in ("json", "json_or_sse"):
            continue
        (member,) = members
        produced = member.rsplit("{", 1)[1].rstrip("}")
        source = "$response.body#/id" if method == "POST" else "$response.body#/data/0/id"
        own = set(re.findall(r"\{(\w+)\}", path))
        links: dict[str, Any] = {}
        for m, p, _ in routes:
            params = set(re.findall(r"\{(\w+)\}", p))
            if produced not in params or not params <= own | {produced}:
                continue
            values = {f"path.{name}": f"$request.path.{name}" for name in sorted(params - {produced})}
            values[f"path.{produced}"] = source
            links[operation_ids[(m, p)]] = {"operationId": operation_ids[(m, p)], "parameters": values}
        if links:
            out[(method, path)] = links
    return out


def _routes(app: FastAPI) -> list[RouteContext]:
    """The app's API routes as served: full paths, router dependencies included."""
    return [r for r in iter_route_contexts(app.routes) if isinstance(r.original_route, APIRoute)]


def _uses(route: RouteContext, dependency: Any) -> bool:
    stack = list(route.dependant.dependencies)
    while stack:
        dep = stack.pop()
        if dep.call is dependency:
            return True
        stack.extend(dep.dependencies)
    return False


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """The document for ``app``; it raises if a route is missing from ``OPERATIONS``."""
    from gateway.routes.files import FILE_PURPOSES

    routes = _routes(app)
    table = [(method, str(r.path), str(r.name)) for r in routes for method in sorted(r.methods or ())]
    missing = {(m, p) for m, p, _ in table} ^ set(OPERATIONS)
    if missing:
        raise RuntimeError(f"OPERATIONS and the route table differ: {sorted(missing)}")
    names = [name for _, _, name in table]
    if len(set(names)) != len(names):
        raise RuntimeError("route function names are not unique operation IDs")

    ops = OPERATIONS.values()
    models = [op.response for op in ops if op.response is not None] + [op.request for op in ops if op.request is not None]
    refs, components = _schemas([*models, ErrorResponse, AgentSessionEvent])
    upload = components["FileUploadForm"]
    upload["properties"]["purpose"]["enum"] = sorted(FILE_PURPOSES)
    upload["properties"]["file"] = {"type": "string", "format": "binary"}

    document = get_openapi(
        title="Berth",
        version="v1",
        openapi_version="3.1.0",
        summary="The OpenAI Agents API (client.beta.agents), self-hosted.",
        description=(
            "Request bodies are validated strictly (unknown top-level fields are a 400 validation_error); "
            "responses parse with the official openai SDK's models. Every error is the OpenAI error envelope."
        ),
        routes=routes,
    )
    links = _links(table)
    idempotency = get_args(IdempotencyDep)[1].dependency
    for route in routes:
        path = str(route.path)
        for method in route.methods or ():
            op = OPERATIONS[(method, path)]
            entry = document["paths"][path][method.lower()]
            entry["operationId"] = route.name
            entry["summary"] = op.summary
            entry.pop("description", None)
            parameters = list(entry.get("parameters", []))
            authenticated = _uses(route, authorize)
            if authenticated and requires_beta_header(path):
                parameters.append(
                    {
                        "name": "OpenAI-Beta",
                        "in": "header",
                        "required": True,
                        "schema": {"type": "string", "const": BETA_HEADER_VALUE},
                    }
                )
            if _uses(route, idempotency):
                parameters.append(
                    {
                        "name": IDEMPOTENCY_HEADER.title(),
                        "in": "header",
                        "required": False,
                        "description": "Replays the first outcome for a retried create with the same body.",
                        "schema": {"type": "string", "minLength": 1, "maxLength": 255},
                    }
                )
            if parameters:
                entry["parameters"] = parameters
            body = _request_body(op, refs)
            if body is not None:
                entry["requestBody"] = body
            success = _success(op, refs)
            if (method, path) in links:
                success["links"] = links[(method, path)]
            responses: dict[str, Any] = {str(op.status): success}
            if authenticated:
                responses.update({code: {"$ref": f"#/components/responses/Error{code}"} for code in ("400", "401", "403")})
                if "{" in path:
                    responses["404"] = {"$ref": "#/components/responses/Error404"}
            elif path == "/readyz":
                responses["503"] = {"description": "Not ready", "content": _json(refs["ProbeReport"])}
            responses["default"] = {"$ref": "#/components/responses/Error"}
            entry["responses"] = responses
            entry["security"] = [{"bearerAuth": []}] if authenticated else []
    error = _json(refs["ErrorResponse"])
    document["components"] = {
        "schemas": components,
        "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer", "description": "An organization API key"}},
        "responses": {
            "Error": {"description": "An error, in the OpenAI error envelope", "content": error},
            **{f"Error{code}": {"description": text, "content": error} for code, text in _ERROR_STATUSES.items()},
        },
    }
    return document
