from __future__ import annotations

import openai
import pytest

from berth.session.v1 import session_pb2
from gateway_support import Stack


async def test_artifact_metadata_content_and_deletion(stack: Stack) -> None:
    fake = stack.session.add_session(stack.org_id)
    artifact = stack.session.add_artifact(fake, "/workspace/outputs/report.md", b"# Report\n")
    base = f"/v1/agents/sessions/{fake.session.id}/artifacts"
    async with stack.client() as client:
        listed = await client.get(base)
        content = await client.get(f"{base}/{artifact.id}/content", headers={"Accept": "application/octet-stream"})
        deleted = await client.delete(f"{base}/{artifact.id}")
        gone = await client.get(f"{base}/{artifact.id}")
    assert listed.json()["data"] == [
        {
            "id": artifact.id,
            "object": "agent.session.artifact",
            "created_at": artifact.create_time.seconds,
            "environment_id": artifact.environment_id,
            "path": "/workspace/outputs/report.md",
            "session_id": fake.session.id,
            "size_bytes": 9,
            "turn_id": "turn_1",
        }
    ]
    assert listed.json()["first_id"] == listed.json()["last_id"] == artifact.id
    assert content.content == b"# Report\n" and content.headers["content-type"].startswith("text/markdown")
    assert deleted.json() == {"id": artifact.id, "object": "agent.session.artifact.deleted", "deleted": True}
    assert gone.status_code == 404


async def test_sdk_reads_artifact_content(stack: Stack) -> None:
    fake = stack.session.add_session(stack.org_id)
    artifact = stack.session.add_artifact(fake, "/workspace/outputs/data.bin", bytes(range(10)))
    client = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key=stack.key, max_retries=0)
    content = await client.beta.agents.sessions.artifacts.content(artifact.id, session_id=fake.session.id)
    await client.close()
    assert content.content == bytes(range(10))


async def test_session_without_embedded_environment_is_rendered_from_the_environment_service(stack: Stack) -> None:
    env = stack.environment.add_environment(stack.org_id)
    fake = stack.session.add_session(stack.org_id)
    fake.session.environment_kind = session_pb2.ENVIRONMENT_KIND_HOSTED
    fake.session.environment_id = env.id
    async with stack.client() as client:
        body = (await client.get(f"/v1/agents/sessions/{fake.session.id}")).json()
    assert body["environment"]["id"] == env.id
    assert body["environment"]["status"] == "pending" and body["environment"]["lifetime"] == "private"


async def test_session_deletion_returns_the_deleted_shape(stack: Stack) -> None:
    fake = stack.session.add_session(stack.org_id)
    async with stack.client() as client:
        response = await client.delete(f"/v1/agents/sessions/{fake.session.id}")
    assert response.json() == {"id": fake.session.id, "object": "agent.session.deleted", "deleted": True}


async def test_environment_files_list_uses_token_pagination(stack: Stack) -> None:
    env = stack.environment.add_environment(stack.org_id)
    async with stack.client() as client:
        for name in ("a", "b", "c"):
            created = await client.post(
                f"/v1/agents/environments/{env.id}/files", json={"type": "inline", "path": f"/workspace/{name}", "data": "eA=="}
            )
            assert created.status_code == 200
        first = (await client.get(f"/v1/agents/environments/{env.id}/files", params={"limit": 2})).json()
        second = (
            await client.get(f"/v1/agents/environments/{env.id}/files", params={"limit": 2, "page": first["next"]})
        ).json()
        outside = await client.get(f"/v1/agents/environments/{env.id}/files", params={"path": "/etc"})
    assert [f["path"] for f in first["data"]] == ["/workspace/a", "/workspace/b"] and first["has_more"] is True
    assert [f["path"] for f in second["data"]] == ["/workspace/c"] and second["next"] is None
    assert first["data"][0]["object"] == "agent.environment.file" and first["data"][0]["environment_id"] == env.id
    assert (outside.status_code, outside.json()["error"]["param"]) == (400, "path")


@pytest.mark.parametrize("purpose", ["nonsense", "evals", "batch_output"])
async def test_file_upload_with_a_purpose_berth_cannot_serve_is_rejected_and_stores_nothing(stack: Stack, purpose: str) -> None:
    # "evals" is a create param the SDK's FileObject cannot carry back, and
    # Berth runs no evals; "*_output" purposes are never uploaded.
    async with stack.client(beta=False) as client:
        response = await client.post("/v1/files", files={"file": ("a.txt", b"x")}, data={"purpose": purpose})
        listed = await client.get("/v1/files")
    assert (response.status_code, response.json()["error"]["param"]) == (400, "purpose")
    assert listed.status_code == 200 and listed.json()["data"] == []


async def test_readyz_reports_serving_upstreams_without_auth(stack: Stack) -> None:
    async with stack.client() as client:
        response = await client.get("/readyz", headers={"Authorization": ""})
    assert response.status_code == 200
    assert response.json()["checks"] == {"session": "SERVING", "environment": "SERVING", "database": "SERVING"}


async def test_metrics_count_requests_by_route_template(stack: Stack) -> None:
    env = stack.environment.add_environment(stack.org_id)
    async with stack.client() as client:
        await client.get(f"/v1/agents/environments/{env.id}")
        metrics = await client.get("/metrics", headers={"Authorization": ""})
    assert metrics.status_code == 200
    assert (
        'berth_http_requests_total{method="GET",route="/v1/agents/environments/{environment_id}",status="200"}'
        in metrics.text
    )




async def test_request_id_is_returned_and_forwarded_to_the_service(stack: Stack) -> None:
    async with stack.client() as client:
        given = await client.get("/v1/agents/environments", headers={"X-Request-ID": "req-from-caller"})
        generated = await client.get("/v1/agents/environments")
    assert given.headers["x-request-id"] == "req-from-caller"
    assert generated.headers["x-request-id"].startswith("req_")
    assert stack.environment.request_ids == ["req-from-caller", generated.headers["x-request-id"]]
