"""The OpenAI Files API subset the agents helpers use: ``/v1/files``.

The SDK sends no ``OpenAI-Beta`` header here. Uploads are multipart with
``file``, ``purpose`` and optionally ``expires_after[anchor]`` /
``expires_after[seconds]``.
"""

from __future__ import annotations

import hashlib
import json
import mimetypes
from typing import Annotated, Any

from fastapi import Query, Request
from fastapi.responses import Response
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from berth.environment.v1 import environment_service_pb2 as pb
from gateway import render
from gateway.errors import ApiError
from gateway.idempotency import IdempotencyDep
from gateway.routes._common import json_response, require_id, stream_content, v1_router
from gateway.state import EnvironmentStubDep

__all__ = ["router", "FILE_PURPOSES"]

router = v1_router()

# What a client may upload and the SDK's FileObject can carry back. "evals"
# (a create param) is refused: Berth runs no evals, and the SDK's FileObject
# does not admit it; "*_output" purposes are the API's own, never uploaded.
FILE_PURPOSES = frozenset({"assistants", "batch", "fine-tune", "vision", "user_data"})
_MIN_EXPIRY_S, _MAX_EXPIRY_S = 3600, 2_592_000


@router.post("/files")
async def create_file(request: Request, stub: EnvironmentStubDep, idempotency: IdempotencyDep) -> Response:
    try:
        form = await request.form()
    except StarletteHTTPException:
        raise
    except Exception as exc:  # python-multipart parse errors
        raise ApiError(400, "invalid_request", "The multipart body could not be parsed.") from exc
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise ApiError(400, "validation_error", "A file part is required.", param="file")
    purpose = form.get("purpose")
    if not isinstance(purpose, str) or purpose not in FILE_PURPOSES:
        raise ApiError(400, "validation_error", f"Invalid purpose: {purpose!r}.", param="purpose")
    expires_after_s = 0
    anchor, seconds = form.get("expires_after[anchor]"), form.get("expires_after[seconds]")
    if anchor is not None or seconds is not None:
        if anchor != "created_at":
            raise ApiError(400, "validation_error", "anchor must be 'created_at'.", param="expires_after.anchor")
        try:
            expires_after_s = int(str(seconds))
        except ValueError:
            expires_after_s = -1
        if not _MIN_EXPIRY_S <= expires_after_s <= _MAX_EXPIRY_S:
            raise ApiError(
                400, "validation_error", "seconds must be between 3600 and 2592000.", param="expires_after.seconds"
            )
    data = await upload.read()
    filename = upload.filename or "upload"
    # Multipart boundaries differ between retries, so idempotency compares
    # the meaning of the request, not its bytes.
    request_hash = hashlib.sha256(
        json.dumps([filename, purpose, expires_after_s, hashlib.sha256(data).hexdigest()]).encode()
    ).hexdigest()
    async with idempotency.begin(request_hash) as idem:
        if idem.replay is not None:
            return idem.replay.to_response()
        response = await stub.CreateStoredFile(
            pb.CreateStoredFileRequest(filename=filename, purpose=purpose, data=data, expires_after_s=expires_after_s)
        )
        content = render.stored_file(response.file)
        await idem.store(200, json.dumps(content))
        return json_response(content)


@router.get("/files")
async def list_files(
    stub: EnvironmentStubDep,
    after: Annotated[str | None, Query()] = None,
    limit: Annotated[int | None, Query(ge=1, le=10_000)] = None,
    purpose: Annotated[str | None, Query()] = None,
) -> dict[str, Any]:
    response = await stub.ListStoredFiles(
        pb.ListStoredFilesRequest(page_size=limit or 0, after=after or "", purpose=purpose or "")
    )
    return render.cursor_page([render.stored_file(f) for f in response.files], response.has_more)


@router.get("/files/{file_id}")
async def retrieve_file(file_id: str, stub: EnvironmentStubDep) -> dict[str, Any]:
    response = await stub.GetStoredFile(pb.GetStoredFileRequest(file_id=require_id(file_id, "file")))
    return render.stored_file(response.file)


@router.get("/files/{file_id}/content")
async def file_content(file_id: str, stub: EnvironmentStubDep) -> Response:
    # Metadata first: an unknown file is a 404 before any byte is sent.
    meta = await stub.GetStoredFile(pb.GetStoredFileRequest(file_id=require_id(file_id, "file")))
    media_type = mimetypes.guess_type(meta.file.filename)[0] or "application/octet-stream"
    call = stub.GetStoredFileContent(pb.GetStoredFileContentRequest(file_id=file_id))

    return stream_content(call, media_type)


@router.delete("/files/{file_id}")
async def delete_file(file_id: str, stub: EnvironmentStubDep) -> dict[str, Any]:
    response = await stub.DeleteStoredFile(pb.DeleteStoredFileRequest(file_id=require_id(file_id, "file")))
    return render.deleted(response.file_id or file_id, "file")
