"""A provider's object API for tests, as the official `openai` client speaks it: Files (multipart
upload, list, retrieve, content, delete) and Batches (create from an input file, retrieve, list).
Objects belong to the account of the key that created them (`Authorization: Bearer KEY`), as at
the provider: one account's key sees all of that account's objects, and none of another's.
`seed(key, ...)` puts an object there that runcap never saw created. Errors have the provider's
shape, as the scripted upstream writes it (`openai_error_body`).

Not a wire format of the scripted upstream: the scripted upstream holds no files, and its stored
responses are keyed by response id, not by account; what the two share is the error shape."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from proxy.scripted_upstream.openai_common import openai_error_body
from proxy.scripted_upstream.wire import JSON
from tests.support.local_app import serve_local


@dataclass
class ObjectHit:
    method: str
    path: str
    key: str  # the bearer key the request carried


@dataclass
class ProviderObjects:
    files: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)  # key → id → file
    contents: dict[str, bytes] = field(default_factory=dict)
    batches: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    hits: list[ObjectHit] = field(default_factory=list)
    url: str | None = None
    _runner: web.AppRunner | None = None

    async def start(self) -> ProviderObjects:
        app = web.Application()
        app.router.add_post("/v1/files", self._create_file)
        app.router.add_get("/v1/files", self._list_files)
        app.router.add_get("/v1/files/{id}", self._get_file)
        app.router.add_get("/v1/files/{id}/content", self._file_content)
        app.router.add_delete("/v1/files/{id}", self._delete_file)
        app.router.add_post("/v1/batches", self._create_batch)
        app.router.add_get("/v1/batches", self._list_batches)
        app.router.add_get("/v1/batches/{id}", self._get_batch)
        self._runner, self.url = await serve_local(app)
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def seed(self, key: str, filename: str) -> str:
        return self._add_file(key, filename, b"seeded", "assistants")["id"]

    def hits_on(self, object_id: str) -> list[ObjectHit]:
        return [h for h in self.hits if object_id in h.path]

    # -- the routes -------------------------------------------------------------------------------

    def _key(self, request: web.Request) -> str:
        key = request.headers.get("Authorization", "").removeprefix("Bearer ")
        self.hits.append(ObjectHit(request.method, request.path, key))
        return key

    def _add_file(self, key: str, filename: str, data: bytes, purpose: str) -> dict[str, Any]:
        oid = f"file-{secrets.token_hex(8)}"
        obj = {"id": oid, "object": "file", "bytes": len(data), "created_at": int(time.time()),
               "filename": filename, "purpose": purpose, "status": "processed"}  # fmt: skip
        self.files.setdefault(key, {})[oid] = obj
        self.contents[oid] = data
        return obj

    async def _create_file(self, request: web.Request) -> web.Response:
        key = self._key(request)
        form = await request.post()
        upload = form["file"]
        assert isinstance(upload, web.FileField)
        return web.json_response(
            self._add_file(key, upload.filename, upload.file.read(), str(form["purpose"]))
        )

    async def _list_files(self, request: web.Request) -> web.Response:
        data = list(self.files.get(self._key(request), {}).values())
        ids = [f["id"] for f in data]
        page = {"object": "list", "data": data, "has_more": False,
                "first_id": ids[0] if ids else None, "last_id": ids[-1] if ids else None}  # fmt: skip
        return web.json_response(page)

    def _file(self, request: web.Request) -> dict[str, Any]:
        obj = self.files.get(self._key(request), {}).get(request.match_info["id"])
        if obj is None:
            message = f"No such File object: {request.match_info['id']}"
            raise web.HTTPNotFound(body=openai_error_body(404, message, None), content_type=JSON)
        return obj

    async def _get_file(self, request: web.Request) -> web.Response:
        return web.json_response(self._file(request))

    async def _file_content(self, request: web.Request) -> web.Response:
        return web.Response(body=self.contents[self._file(request)["id"]])

    async def _delete_file(self, request: web.Request) -> web.Response:
        obj = self._file(request)
        del self.files[request.headers["Authorization"].removeprefix("Bearer ")][obj["id"]]
        return web.json_response({"id": obj["id"], "object": "file", "deleted": True})

    async def _create_batch(self, request: web.Request) -> web.Response:
        key = self._key(request)
        body = await request.json()
        if body.get("input_file_id") not in self.files.get(key, {}):
            message = f"No such File object: {body.get('input_file_id')}"
            raise web.HTTPBadRequest(
                body=openai_error_body(400, message, None, "input_file_id"), content_type=JSON
            )
        oid = f"batch_{secrets.token_hex(8)}"
        batch = {"id": oid, "object": "batch", "endpoint": body["endpoint"],
                 "input_file_id": body["input_file_id"], "completion_window": body["completion_window"],
                 "status": "validating", "created_at": int(time.time())}  # fmt: skip
        self.batches.setdefault(key, {})[oid] = batch
        return web.json_response(batch)

    async def _list_batches(self, request: web.Request) -> web.Response:
        data = list(self.batches.get(self._key(request), {}).values())
        return web.json_response({"object": "list", "data": data, "has_more": False})

    async def _get_batch(self, request: web.Request) -> web.Response:
        batch = self.batches.get(self._key(request), {}).get(request.match_info["id"])
        if batch is None:
            message = f"No such Batch object: {request.match_info['id']}"
            raise web.HTTPNotFound(body=openai_error_body(404, message, None), content_type=JSON)
        return web.json_response(batch)
