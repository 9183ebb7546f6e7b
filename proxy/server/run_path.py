"""`/r/{run_id}[/p/{parent_id}][/t/{task}]/<route>`: run identity in the path, for agents that can
set a base URL but no headers (`OPENAI_BASE_URL=http://host:8787/r/ticket-4711/v1`; a sub-agent's
`.../r/ticket-4711-a/p/ticket-4711/v1`). The route behind it is served exactly as if the run (its
parent, its task) had come as `X-Run-Id` / `X-Run-Parent` / `X-Run-Task`."""

from __future__ import annotations

from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from proxy.caps import RUN_ID_RE
from proxy.errors import InvalidRequest
from proxy.upstream_url import decode_segment, remaining_segments


def run_path_request(request: web.Request) -> web.Request:
    """`/r/{run_id}[/p/{parent_id}][/t/{task}]/<route>` → the same request for `<route>` with
    `X-Run-Id` (and `X-Run-Parent`, `X-Run-Task`) set; a header that disagrees with the path is a
    400. The rest of the target is kept exactly as received (still encoded), so the route's own
    checks see what was sent."""
    segments, query = remaining_segments(request.raw_path, 0)  # checks the whole target
    if len(segments) < 3:
        raise InvalidRequest("/r/{run_id}/...: the route after the run id is missing", param="path")
    run_id = decode_segment(segments[1])
    if not RUN_ID_RE.match(run_id):
        raise InvalidRequest(
            f"/r/{{run_id}}: {run_id[:140]!r} is not a run id (1-128 characters of A-Z a-z 0-9 . _ : -)",
            param="X-Run-Id",
        )
    rest = segments[2:]
    headers = CIMultiDict(request.headers)
    _agree(headers, "X-Run-Id", run_id)
    if len(rest) >= 3 and rest[0] == "p":
        parent = decode_segment(rest[1])
        if not RUN_ID_RE.match(parent):
            raise InvalidRequest(
                f"/r/{{run_id}}/p/{{parent_id}}: {parent[:140]!r} is not a run id (1-128 characters of "
                "A-Z a-z 0-9 . _ : -)",
                param="X-Run-Parent",
            )
        _agree(headers, "X-Run-Parent", parent)
        rest = rest[2:]
    if len(rest) >= 3 and rest[0] == "t":
        task = decode_segment(rest[1])
        if len(task) > 256 or not task.isprintable():
            raise InvalidRequest("/r/{run_id}/t/{task}: at most 256 printable characters", param="X-Run-Task")
        _agree(headers, "X-Run-Task", task)
        rest = rest[2:]
    target = "/" + "/".join(rest) + (f"?{query}" if query else "")
    return request.clone(rel_url=URL(target, encoded=True), headers=headers)


def _agree(headers: CIMultiDict[str], name: str, value: str) -> None:
    given = headers.getall(name, [])
    if len(given) > 1:
        raise InvalidRequest(f"{name}: sent {len(given)} times; send it once", param=name)
    if any(v != value for v in given):
        raise InvalidRequest(
            f"{name}: {given[0][:140]!r} disagrees with the path ({value!r}); send one or the other",
            param=name,
        )
    headers[name] = value
