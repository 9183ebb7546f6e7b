"""Reading an agent's request body: one function for the model, tool and MCP routes.

aiohttp decodes a body sent with `Content-Encoding: gzip` or `deflate` (and `br` / `zstd` when
their libraries are installed) as it reads it; any other coding it hands over as is. runcap meters,
hashes and forwards what it read, so it reads only what it can decode: an unknown coding is a 415
naming `Content-Encoding`, a body that does not decode a 400, one larger than `max_body_bytes`
(decoded) a 413. What is forwarded is the decoded body, and the headers say so
(`request_headers` drops `Content-Encoding`; the length is recomputed).
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.compression_utils import HAS_BROTLI, HAS_ZSTD
from aiohttp.web_protocol import RequestPayloadError

from proxy.errors import InvalidRequest, PayloadTooLarge

# The codings aiohttp's parser decodes (a single coding, case-insensitive), as installed here.
DECODED = frozenset({"gzip", "deflate", *(("br",) if HAS_BROTLI else ()), *(("zstd",) if HAS_ZSTD else ())})


def content_coding(request: web.BaseRequest) -> str | None:
    """The request's coding when runcap reads it decoded (None: identity); else a 415."""
    given = request.headers.getall("Content-Encoding", [])
    if not given:
        return None
    coding = given[0].strip().lower() if len(given) == 1 else ""
    if coding == "identity":
        return None
    if coding in DECODED and given[0].isascii():
        return coding
    raise InvalidRequest(
        f"Content-Encoding: {', '.join(given)[:60]!r} is not a coding runcap reads (it can: "
        f"{', '.join(sorted(DECODED))}, or none); send the body uncompressed or with one of those",
        param="Content-Encoding",
        status=415,
    )


async def read_body(request: web.BaseRequest, max_body_bytes: int) -> bytes:
    """The request's body, decoded; a `Rejection` (415, 400, 413) when it cannot be read."""
    coding = content_coding(request)
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(
            f"request body is larger than max_body_bytes = {max_body_bytes} bytes"
            + (" (decoded)" if coding else ""),
            param="max_body_bytes",
        ) from None
    except RequestPayloadError as e:
        if coding is None:
            raise
        raise InvalidRequest(
            f"Content-Encoding: the body is not valid {coding} data ({e})", param="Content-Encoding"
        ) from None
