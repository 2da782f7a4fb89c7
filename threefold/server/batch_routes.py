"""/v1/files and /v1/batches, in OpenAI's shapes (the official client's files.* and batches.* work unchanged)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel

from threefold.batch.validate import check_batch_request, check_upload
from threefold.errors import ThreefoldError
from threefold.server.serving_batch import BatchService
from threefold.server.serving_common import ServerState


class CreateBatchRequest(BaseModel):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


def add_batch_routes(app: FastAPI, state: ServerState) -> None:
    def service() -> BatchService:
        if state.batch is None:
            raise ThreefoldError("The Batch API is off on this server (it has no --batch-dir).", status_code=404)
        return state.batch

    @app.post("/v1/files")
    async def create_file(raw_request: Request) -> dict:
        form = await raw_request.form(max_part_size=service().limits.max_file_bytes + 1)
        upload, purpose = form.get("file"), form.get("purpose")
        if upload is None or isinstance(upload, str):
            raise ThreefoldError("Send the file as the multipart field 'file'.", param="file")
        data = await upload.read()
        check_upload(purpose if isinstance(purpose, str) else None, len(data), service().limits)
        return service().store.add_file(data, upload.filename or "upload.jsonl", "batch")

    @app.get("/v1/files")
    async def list_files(purpose: str | None = None) -> dict:
        return {"object": "list", "data": service().store.list_files(purpose), "has_more": False}

    @app.get("/v1/files/{file_id}")
    async def retrieve_file(file_id: str) -> dict:
        return service().store.get_file(file_id)

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str) -> dict:
        return service().store.delete_file(file_id)

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str) -> Response:
        return Response(service().store.file_content(file_id), media_type="application/octet-stream")

    @app.post("/v1/batches")
    async def create_batch(req: CreateBatchRequest) -> dict:
        store = service().store
        file = store.get_file(req.input_file_id)
        check_batch_request(req.endpoint, req.completion_window, file["purpose"])
        return store.create_batch(req.input_file_id, req.endpoint, req.metadata).to_dict()

    @app.get("/v1/batches")
    async def list_batches(after: str | None = None, limit: int = 20) -> dict:
        if not 1 <= limit <= 100:
            raise ThreefoldError(f"limit must be between 1 and 100, got {limit}.", param="limit")
        batches = [b.to_dict() for b in service().store.list_batches(after, limit + 1)]
        page = batches[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(batches) > limit}

    @app.get("/v1/batches/{batch_id}")
    async def retrieve_batch(batch_id: str) -> dict:
        return service().store.get_batch(batch_id).to_dict()

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str) -> dict:
        return service().store.cancel_batch(batch_id).to_dict()
