"""The OpenAPI document at /v1/openapi.json: public, valid OpenAPI 3.1,
one operation per route of the gateway, request bodies from the models the
gateway validates with, responses from the SDK's types, errors in the
OpenAI envelope."""

from __future__ import annotations

from typing import Any

import httpx
from fastapi.routing import APIRoute, iter_route_contexts
from openai.types.beta.agent import Agent
from openapi_spec_validator import OpenAPIV31SpecValidator

from gateway.openapi import OPENAPI_PATH
from gateway.validation import AgentCreateBody, SessionCreateBody
from gateway_support import Stack


async def _document(stack: Stack) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=10) as client:
        response = await client.get(OPENAPI_PATH)
    assert response.status_code == 200
    document: dict[str, Any] = response.json()
    return document


def _component(document: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    name = ref["$ref"].removeprefix("#/components/schemas/")
    schema: dict[str, Any] = document["components"]["schemas"][name]
    return schema


async def test_the_document_is_served_without_auth_and_is_valid_openapi_3_1(stack: Stack) -> None:
    document = await _document(stack)
    assert document["openapi"].startswith("3.1.")
    OpenAPIV31SpecValidator(document).validate()


async def test_the_document_has_one_operation_per_route_of_the_gateway(stack: Stack) -> None:
    document = await _document(stack)
    routes = {
        (method.lower(), str(route.path))
        for route in iter_route_contexts(stack.gateway.app.routes)
        if isinstance(route.original_route, APIRoute)
        for method in route.methods or ()
    }
    documented = {(method, path) for path, operations in document["paths"].items() for method in operations}
    assert documented == routes
    assert len(routes) > 30


async def test_request_bodies_are_the_schemas_of_the_validation_models(stack: Stack) -> None:
    document = await _document(stack)
    for path, model in (("/v1/agents", AgentCreateBody), ("/v1/agents/sessions", SessionCreateBody)):
        body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        schema = _component(document, body)
        expected = model.model_json_schema()
        assert set(schema["properties"]) == set(expected["properties"])
        assert set(schema.get("required", [])) == set(expected.get("required", []))
        # Strict top-level bodies: an unknown field is documented as refused.
        assert schema["additionalProperties"] is False


async def test_responses_are_the_sdk_types_and_errors_use_the_envelope(stack: Stack) -> None:
    document = await _document(stack)
    create = document["paths"]["/v1/agents"]["post"]
    agent = _component(document, create["responses"]["200"]["content"]["application/json"]["schema"])
    assert set(agent["required"]) == {n for n, f in Agent.model_fields.items() if f.is_required()}
    assert create["security"] == [{"bearerAuth": []}]
    error = document["components"]["responses"]["Error"]["content"]["application/json"]["schema"]
    envelope = _component(document, error)
    assert envelope["required"] == ["error"]
    error_object = _component(document, envelope["properties"]["error"])
    assert {"message", "type", "param", "code"} <= set(error_object["properties"])
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            assert operation["responses"]["default"] == {"$ref": "#/components/responses/Error"}, (method, path)


async def test_only_the_agents_routes_document_the_beta_header(stack: Stack) -> None:
    document = await _document(stack)

    def headers(path: str, method: str) -> set[str]:
        params = document["paths"][path][method].get("parameters", [])
        return {p["name"] for p in params if p["in"] == "header"}

    assert "OpenAI-Beta" in headers("/v1/agents/sessions", "get")
    assert "OpenAI-Beta" not in headers("/v1/files", "get")
    assert document["paths"]["/readyz"]["get"]["security"] == []
