"""The organization file store and the environment files API."""

from __future__ import annotations

import base64
import hashlib
import io
import zipfile
from pathlib import Path

import grpc
import pytest
from environment_fakes import FakeCompute
from environment_helpers import Cluster, EnvService, create_env, ensure, md, reason_of

from berth.environment.v1 import environment_pb2, environment_service_pb2 as pb


async def store(service: EnvService, data: bytes, org: str = "org_a", purpose: str = "assistants", **kwargs: object) -> environment_pb2.StoredFile:
    response = await service.stub.CreateStoredFile(
        pb.CreateStoredFileRequest(filename="a.txt", purpose=purpose, data=data, **kwargs), metadata=md(org)  # type: ignore[arg-type]
    )
    return response.file


async def content(service: EnvService, file_id: str, org: str = "org_a") -> bytes:
    data = b""
    async for chunk in service.stub.GetStoredFileContent(pb.GetStoredFileContentRequest(file_id=file_id), metadata=md(org)):
        data += chunk.data
    return data


def blob_path(service: EnvService, sha256: str) -> Path:
    return service.settings.data_dir / "blobs" / sha256[:2] / sha256


async def test_a_stored_file_round_trips_its_metadata_and_content(env_service: EnvService) -> None:
    data = b"hello world" * 1000
    created = await store(env_service, data)
    assert created.id.startswith("file-") and created.size_bytes == len(data)
    assert created.sha256 == hashlib.sha256(data).hexdigest()
    assert not created.HasField("expire_time")
    fetched = await env_service.stub.GetStoredFile(pb.GetStoredFileRequest(file_id=created.id), metadata=md())
    assert fetched.file == created
    assert await content(env_service, created.id) == data
    assert blob_path(env_service, created.sha256).read_bytes() == data


async def test_stored_files_are_scoped_to_their_organization(env_service: EnvService) -> None:
    created = await store(env_service, b"secret")
    calls = (
        env_service.stub.GetStoredFile(pb.GetStoredFileRequest(file_id=created.id), metadata=md("org_b")),
        content(env_service, created.id, org="org_b"),
        env_service.stub.DeleteStoredFile(pb.DeleteStoredFileRequest(file_id=created.id), metadata=md("org_b")),
        env_service.stub.GetStoredFile(pb.GetStoredFileRequest(file_id="file-malformed"), metadata=md()),
    )
    for call in calls:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    listed = await env_service.stub.ListStoredFiles(pb.ListStoredFilesRequest(), metadata=md("org_b"))
    assert list(listed.files) == []
    assert await content(env_service, created.id) == b"secret"


async def test_deleting_a_stored_file_keeps_content_another_file_still_uses(env_service: EnvService) -> None:
    mine = await store(env_service, b"same bytes")
    theirs = await store(env_service, b"same bytes", org="org_b")
    assert mine.sha256 == theirs.sha256
    await env_service.stub.DeleteStoredFile(pb.DeleteStoredFileRequest(file_id=mine.id), metadata=md())
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await env_service.stub.GetStoredFile(pb.GetStoredFileRequest(file_id=mine.id), metadata=md())
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert await content(env_service, theirs.id, org="org_b") == b"same bytes"
    await env_service.stub.DeleteStoredFile(pb.DeleteStoredFileRequest(file_id=theirs.id), metadata=md("org_b"))
    assert not blob_path(env_service, mine.sha256).exists()


async def test_stored_files_list_newest_first_with_purpose_filter_and_cursor(env_service: EnvService) -> None:
    created = [await store(env_service, f"{i}".encode(), purpose="batch" if i == 1 else "assistants") for i in range(4)]
    batch_id = created[1].id
    ids = sorted(f.id for f in created)  # IDs order by creation time; ties break randomly
    page = await env_service.stub.ListStoredFiles(pb.ListStoredFilesRequest(page_size=2), metadata=md())
    assert [f.id for f in page.files] == [ids[3], ids[2]] and page.has_more
    rest = await env_service.stub.ListStoredFiles(pb.ListStoredFilesRequest(page_size=2, after=ids[2]), metadata=md())
    assert [f.id for f in rest.files] == [ids[1], ids[0]] and not rest.has_more
    batch = await env_service.stub.ListStoredFiles(pb.ListStoredFilesRequest(purpose="batch"), metadata=md())
    assert [f.id for f in batch.files] == [batch_id]


async def test_an_oversized_stored_file_is_invalid(cluster: Cluster, sqlite_url: str, fake: FakeCompute) -> None:
    service = await cluster.start(sqlite_url, compute=fake, max_body_bytes=8)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await store(service, b"123456789")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_stored_file_with_an_expiry_reports_it(env_service: EnvService) -> None:
    created = await store(env_service, b"x", expires_after_s=3600)
    assert created.expire_time.seconds - created.create_time.seconds == 3600


async def test_environment_files_are_written_and_registered_from_inline_data_or_a_stored_file(
    env_service: EnvService, fake: FakeCompute
) -> None:
    env = (await create_env(env_service.stub)).environment
    stored = await store(env_service, b"from the store")
    inline = await env_service.stub.CreateEnvironmentFile(
        pb.CreateEnvironmentFileRequest(environment_id=env.id, path="/workspace/in.txt", data=b"inline"), metadata=md()
    )
    by_id = await env_service.stub.CreateEnvironmentFile(
        pb.CreateEnvironmentFileRequest(environment_id=env.id, path="/workspace/store.txt", file_id=stored.id), metadata=md()
    )
    assert (inline.file.source, inline.file.size_bytes) == ("inline", 6)
    assert (by_id.file.source, by_id.file.file_id, by_id.file.size_bytes) == ("file_id", stored.id, 14)
    assert fake.files[env.sandbox_id]["/workspace/store.txt"] == b"from the store"
    again = await env_service.stub.CreateEnvironmentFile(
        pb.CreateEnvironmentFileRequest(environment_id=env.id, path="/workspace/in.txt", data=b"replaced"), metadata=md()
    )
    assert again.file.id == inline.file.id and again.file.size_bytes == 8
    other_org_file = await store(env_service, b"theirs", org="org_b")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await env_service.stub.CreateEnvironmentFile(
            pb.CreateEnvironmentFileRequest(environment_id=env.id, path="/workspace/x", file_id=other_org_file.id), metadata=md()
        )
    # Another organization's file reads like a missing one.
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_initial_files_are_written_during_setup_and_registered_with_their_ids(
    env_service: EnvService, fake: FakeCompute
) -> None:
    stored = await store(env_service, b"stored content")
    config = environment_pb2.EnvironmentConfig(
        files=[
            environment_pb2.InitialFile(path="/workspace/input.txt", data=b"Shared input"),
            environment_pb2.InitialFile(path="/workspace/data/s.txt", file_id=stored.id),
        ]
    )
    env = (await create_env(env_service.stub, config=config)).environment
    assert [f.size_bytes for f in env.config.files] == [12, 14]
    ids = {f.path: f.id for f in env.config.files}
    assert all(i.startswith("file-") for i in ids.values())
    await ensure(env_service.stub, env.id)
    assert fake.files[env.sandbox_id]["/workspace/data/s.txt"] == b"stored content"
    listed = await env_service.stub.ListEnvironmentFiles(pb.ListEnvironmentFilesRequest(environment_id=env.id), metadata=md())
    assert {f.path: f.id for f in listed.files} == ids
    assert {f.path: f.source for f in listed.files} == {"/workspace/input.txt": "inline", "/workspace/data/s.txt": "file_id"}


async def test_inline_skills_are_extracted_under_the_skills_directory(env_service: EnvService, fake: FakeCompute) -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        zf.writestr("reviewer/SKILL.md", "# Reviewer")
        zf.writestr("reviewer/scripts/run.sh", "echo hi")
    skill = {
        "type": "inline",
        "name": "reviewer",
        "description": "Reviews",
        "source": {"type": "base64", "media_type": "application/zip", "data": base64.b64encode(buffer.getvalue()).decode()},
    }
    import json

    config = environment_pb2.EnvironmentConfig(
        skills_json=json.dumps([skill, {"type": "skill_reference", "skill_id": "skill_123"}])
    )
    env = (await create_env(env_service.stub, config=config)).environment
    assert (await ensure(env_service.stub, env.id)).status == environment_pb2.ENVIRONMENT_STATUS_READY
    files = fake.files[env.sandbox_id]
    assert files["/workspace/.skills/reviewer/SKILL.md"] == b"# Reviewer"
    assert files["/workspace/.skills/reviewer/scripts/run.sh"] == b"echo hi"


async def test_environment_files_page_in_both_orders_with_opaque_tokens(env_service: EnvService, fake: FakeCompute) -> None:
    env = (await create_env(env_service.stub)).environment
    await ensure(env_service.stub, env.id)
    paths = ["/workspace/a/b", "/workspace/a-b", "/workspace/c", "/workspace/d/e/f", "/workspace/z"]
    for path in paths:
        fake.files[env.sandbox_id][path] = b"x"
    # Component order: "a" < "a-b", so /workspace/a/b sorts before /workspace/a-b.
    expected = ["/workspace/a/b", "/workspace/a-b", "/workspace/c", "/workspace/d/e/f", "/workspace/z"]

    async def walk(order: str) -> list[str]:
        seen: list[str] = []
        token = ""
        while True:
            page = await env_service.stub.ListEnvironmentFiles(
                pb.ListEnvironmentFilesRequest(environment_id=env.id, order=order, page_size=2, page_token=token), metadata=md()
            )
            assert len(page.files) <= 2
            seen += [f.path for f in page.files]
            token = page.next_page_token
            if not token:
                return seen

    assert await walk("asc") == expected
    assert await walk("desc") == expected[::-1]
    assert await walk("") == expected[::-1]  # default order is desc
    scoped = await env_service.stub.ListEnvironmentFiles(
        pb.ListEnvironmentFilesRequest(environment_id=env.id, path="/workspace/d", order="asc"), metadata=md()
    )
    assert [f.path for f in scoped.files] == ["/workspace/d/e/f"] and scoped.files[0].environment_id == env.id
    first = await env_service.stub.ListEnvironmentFiles(
        pb.ListEnvironmentFilesRequest(environment_id=env.id, order="asc", page_size=1), metadata=md()
    )
    bad_requests = [
        pb.ListEnvironmentFilesRequest(environment_id=env.id, page_token="not-a-token"),
        pb.ListEnvironmentFilesRequest(environment_id=env.id, order="desc", page_token=first.next_page_token),
        pb.ListEnvironmentFilesRequest(environment_id=env.id, page_size=101),
        pb.ListEnvironmentFilesRequest(environment_id=env.id, order="sideways"),
    ]
    for request in bad_requests:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await env_service.stub.ListEnvironmentFiles(request, metadata=md())
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_listing_a_missing_directory_is_empty(env_service: EnvService) -> None:
    env = (await create_env(env_service.stub)).environment
    listed = await env_service.stub.ListEnvironmentFiles(
        pb.ListEnvironmentFilesRequest(environment_id=env.id, path="/workspace/nothing"), metadata=md()
    )
    assert list(listed.files) == [] and listed.next_page_token == ""


async def test_workspace_files_round_trip_through_the_guard(env_service: EnvService) -> None:
    env = (await create_env(env_service.stub)).environment
    written = await env_service.stub.WriteWorkspaceFile(
        pb.WriteWorkspaceFileRequest(environment_id=env.id, path="/workspace/notes.md", data=b"# notes"), metadata=md()
    )
    assert written.entry.path == "/workspace/notes.md"
    chunks = [c async for c in env_service.stub.ReadWorkspaceFile(
        pb.ReadWorkspaceFileRequest(environment_id=env.id, path="/workspace/notes.md"), metadata=md()
    )]
    assert b"".join(c.data for c in chunks) == b"# notes" and chunks[0].size_bytes == 7
    listed = await env_service.stub.ListWorkspaceFiles(
        pb.ListWorkspaceFilesRequest(environment_id=env.id, path="/workspace", recursive=True), metadata=md()
    )
    assert [e.path for e in listed.entries] == ["/workspace/notes.md"]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in env_service.stub.ReadWorkspaceFile(
            pb.ReadWorkspaceFileRequest(environment_id=env.id, path="/workspace/missing"), metadata=md()
        ):
            pass
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert reason_of(info.value) == "NOT_FOUND"
