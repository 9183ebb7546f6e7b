"""Tenants who share a provider key do not share what the provider holds for it.

With `[auth] client_tokens` and one configured key per upstream, every tenant's files, stored
completions and responses, batches, vector stores, conversations, uploads, fine-tuning jobs...
live in one provider account, and each of them can be read, listed or deleted by id through
the pass-through routes. The recommended setup gives each tenant its own key
(`client_tokens.TENANT.upstream_keys`): the provider keeps them apart. Where tenants share one,
this step does (`Flow.shares_key`):

* **create** (a POST to a collection: `/v1/files`, `/v1/batches`, `/v1/responses`,
  `/v1/chat/completions`...; an Anthropic message in a `thread`): the id in the provider's
  answer is recorded in the ledger as the tenant's (before the agent gets a buffered answer, at
  the end of a stream), so replicas agree;
* **read, change, delete** of `/v1/{collection}/{id}[/...]`, and a request whose body refers to
  an object (`previous_response_id`, `previous_message_id`, `conversation`, `file_id`,
  `file_ids`, `input_file_id`, `training_file`, `validation_file`, `vector_store_ids`, anywhere
  in the JSON): refused with
  404, as if the object did not exist, unless the tenant created it — an id runcap never saw
  created included (it may be the key owner's own, or older than runcap);
* **list** (a GET of a collection): the answer's `data` keeps the tenant's own objects only.

What an upstream's collections are is the table below, on the path after `/v1` (OpenAI's and
Anthropic's object APIs; an OpenAI-compatible server that has none is unaffected).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.errors import NotFound
from proxy.ledger.base import Ledger
from proxy.server.flow import Flow, FlowStep

# Collections of provider objects, as path segments after /v1. Longest first: matched in order.
COLLECTIONS: tuple[tuple[str, ...], ...] = (
    ("fine_tuning", "jobs"),
    ("chat", "completions"),
    ("messages", "batches"),
    ("files",),
    ("uploads",),
    ("batches",),
    ("vector_stores",),
    ("responses",),
    ("conversations",),
    ("assistants",),
    ("threads",),
    ("containers",),
    ("evals",),
    ("skills",),
)
# Segments after a collection that are endpoints of its own, not object ids.
NOT_IDS: dict[tuple[str, ...], frozenset[str]] = {("responses",): frozenset({"input_tokens", "compact"})}
# Body fields that name provider objects the request reads or uses.
REFERENCE_FIELDS = frozenset(
    {"previous_response_id", "previous_message_id", "conversation", "conversation_id", "file_id", "file_ids",
     "input_file_id", "training_file", "validation_file", "vector_store_id", "vector_store_ids"}
)  # fmt: skip
# What a body naming an object must contain (each field name is, or contains, one of these).
_REFERENCE_NAMES = (
    b"file_id", b"training_file", b"validation_file", b"vector_store_id",
    b"previous_response_id", b"previous_message_id", b"conversation",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class ObjectRoute:
    collection: tuple[str, ...]
    object_id: str | None  # None: the collection itself (create, list)


def object_route(path: str) -> ObjectRoute | None:
    """The provider object (or collection) `path` addresses, if any."""
    segments = _after_v1(path)
    for collection in COLLECTIONS:
        n = len(collection)
        if tuple(segments[:n]) != collection:
            continue
        rest = segments[n:]
        if not rest:
            return ObjectRoute(collection, None)
        if rest[0] in NOT_IDS.get(collection, frozenset()):
            return None
        return ObjectRoute(collection, rest[0])
    return None


def creates(flow: Flow) -> bool:
    """The call makes the provider keep an object under the id of its answer: a POST to a
    collection, or an Anthropic message that starts or continues a thread (its answer's id is
    what the next `thread.previous_message_id` names)."""
    if flow.request.method != "POST":
        return False
    route = object_route(flow.target.path)
    body = flow.body_json
    if route is not None:
        if route.collection == ("chat", "completions"):  # stored only when asked (`store`)
            return route.object_id is None and body is not None and body.get("store") is True
        if route.collection == ("responses",):  # stored unless asked not to
            return route.object_id is None and not (body is not None and body.get("store") is False)
        return route.object_id is None
    return body is not None and "thread" in body and _after_v1(flow.target.path) == ["messages"]


def _after_v1(path: str) -> list[str]:
    segments = [s for s in path.split("/") if s]
    return segments[segments.index("v1") + 1 :] if "v1" in segments else segments


def referenced_ids(body: Any) -> Iterator[str]:
    """Object ids a JSON body refers to (REFERENCE_FIELDS, at any depth: walked with a stack of
    its own, so no nesting hides one)."""
    stack = [body]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key in REFERENCE_FIELDS:
                    yield from _ids(value)
                elif isinstance(value, (dict, list)):
                    stack.append(value)
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))


def _ids(value: Any) -> Iterator[str]:
    if isinstance(value, str) and value:
        yield value
    elif isinstance(value, dict) and isinstance(value.get("id"), str):
        yield value["id"]  # {"conversation": {"id": "conv_..."}}
    elif isinstance(value, list):
        yield from (v for v in value if isinstance(v, str) and v)


class TenantObjects(FlowStep):
    """The flow step (first of them: a refused call reserves and counts nothing)."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    async def request(self, flow: Flow) -> None:
        if not flow.shares_key:
            return
        route = object_route(flow.target.path)
        wanted = set(self._references(flow))
        if route is not None and route.object_id is not None:
            wanted.add(route.object_id)
        if wanted:
            owners = await self.ledger.object_owners(flow.upstream.name, sorted(wanted))
            for oid in sorted(wanted):
                if owners.get(oid) != flow.tenant:
                    # As the provider says of an id that does not exist; nothing about whose it is.
                    raise NotFound(f"No such object: '{oid}'", param="id")
        if route is not None and route.object_id is None:
            flow.buffer_answer = True  # a create's id is read, a list filtered, in `response`

    async def response(self, flow: Flow) -> None:
        if not flow.shares_key or flow.upstream_status >= 400 or flow.response_body is None:
            return
        if creates(flow):
            await self._claim(flow, _answer_id(flow.response_body))
            return
        route = object_route(flow.target.path)
        if route is not None and route.object_id is None and flow.request.method == "GET":
            flow.response_body = await self._filtered(flow, flow.response_body)

    async def done(self, flow: Flow) -> None:
        # A created object whose id came in a stream (a stored response, a stored completion).
        info = flow.response_info
        if (
            flow.shares_key
            and flow.streamed
            and info is not None
            and flow.upstream_status < 400
            and creates(flow)
        ):
            await self._claim(flow, info.response_id)

    def _references(self, flow: Flow) -> Iterator[str]:
        raw = flow.body
        # Most bodies (a chat turn) name no object: no walk through them. A key written with
        # escapes (`"\u0066ile_id"`) means the same to the provider, so such a body is walked.
        if b"\\u" not in raw and not any(name in raw for name in _REFERENCE_NAMES):
            return
        body = flow.body_json
        if body is None:
            try:
                body = orjson.loads(raw)
            except orjson.JSONDecodeError:
                return  # not JSON (a multipart upload): no references
        yield from referenced_ids(body)

    async def _claim(self, flow: Flow, object_id: str) -> None:
        if object_id and flow.tenant is not None:
            await self.ledger.claim_objects(flow.upstream.name, [object_id], flow.tenant, flow.started_wall)

    async def _filtered(self, flow: Flow, body: bytes) -> bytes:
        try:
            page = orjson.loads(body)
        except orjson.JSONDecodeError:
            return body
        if not isinstance(page, dict) or not isinstance(page.get("data"), list):
            return body
        items = page["data"]
        ids = [o["id"] for o in items if isinstance(o, dict) and isinstance(o.get("id"), str)]
        owners = await self.ledger.object_owners(flow.upstream.name, ids) if ids else {}
        kept = [o for o in items if isinstance(o, dict) and owners.get(o.get("id", "")) == flow.tenant]
        page["data"] = kept
        for key, at in (("first_id", 0), ("last_id", -1)):
            if key in page:
                page[key] = kept[at]["id"] if kept else None
        return orjson.dumps(page)


def _answer_id(body: bytes) -> str:
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        return ""
    oid = answer.get("id") if isinstance(answer, dict) else None
    return oid if isinstance(oid, str) else ""
