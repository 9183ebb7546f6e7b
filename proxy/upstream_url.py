"""Upstream URLs are built, not concatenated (DESIGN.md "Trust model").

One builder for every path runcap forwards — model upstreams, pass-through endpoints and tools:
the forwarded path is the configured base path plus the request's remaining path, still
percent-encoded exactly as the agent sent it, and the adapter (what gets metered) is chosen on
the decoded form of that same path. Anything an upstream could read differently from runcap is
refused before it leaves:

* a dot segment, plain or encoded (`..`, `%2e%2E`), anywhere: it would leave the base path, or
  make the metered path and the path the upstream serves differ;
* a `;` (plain or encoded): servers that read path parameters (`completions;x`, `..;/`) would
  serve another path than the one runcap metered;
* an encoded `/`, `?`, `#`, `\\` or `%` (double encoding) inside a segment, a raw `#`, control
  characters, and any byte outside RFC 3986's path characters (raw unicode, spaces, `\\`);
* an empty segment (`//`) except a trailing slash: servers that merge slashes would serve
  `chat//completions` as `chat/completions`.

The HTTP client is then handed the URL as already encoded (`yarl.URL(..., encoded=True)`), so it
neither re-quotes nor normalises what was checked: what runcap chose its adapter on is what the
upstream receives.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes, urlsplit

from yarl import URL

from proxy.errors import InvalidRequest

# RFC 3986 pchar: unreserved / pct-encoded / sub-delims / ":" / "@".
_SEGMENT = re.compile(r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@]|%[0-9A-Fa-f]{2})*")
# A query may also hold "/" and "?"; still printable ASCII only.
_QUERY = re.compile(r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@/?]|%[0-9A-Fa-f]{2})*")
# The common case, checked in one pass: plain path characters, no '%', ';' or '.'-led segment.
_PLAIN_PATH = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,=:@/]*")
_FORBIDDEN_DECODED = re.compile(r"[/?#\\%;\x00-\x1f\x7f]")


class UnsafePath(InvalidRequest):
    """A request path runcap will not forward; the message says which part and why."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="path")


@dataclass(frozen=True, slots=True)
class UpstreamTarget:
    """Where one request goes: the URL to send (still encoded as received) and the decoded
    path the upstream will read (what adapters, allow-lists and spans look at)."""

    url: URL
    path: str  # decoded path as the upstream reads it, without the query
    query: str  # raw query string ('' for none)

    @property
    def path_qs(self) -> str:
        return f"{self.path}?{self.query}" if self.query else self.path


@dataclass(frozen=True, slots=True)
class Base:
    """A configured upstream or tool URL, split once at start-up."""

    origin: str  # scheme://host[:port]
    raw_path: str  # the base path, percent-encoded, without a trailing slash ('' for none)
    path: str  # the same, decoded

    @classmethod
    def parse(cls, url: str) -> Base:
        parts = urlsplit(url)
        raw = parts.path.rstrip("/")
        decoded = "/".join(decode_segment(seg) for seg in raw.split("/")) if raw else ""
        return cls(f"{parts.scheme}://{parts.netloc}", raw, decoded)

    def target(self, segments: list[str], query: str) -> UpstreamTarget:
        """The base plus already checked raw `segments` (see `remaining_segments`)."""
        raw = "/".join(segments)
        decoded = "/".join(decode_segment(seg) for seg in segments)
        sep = "/" if segments else ""
        url = f"{self.origin}{self.raw_path}{sep}{raw}" + (f"?{query}" if query else "")
        return UpstreamTarget(URL(url, encoded=True), f"{self.path}{sep}{decoded}" or "/", query)


def decode_segment(segment: str) -> str:
    if "%" not in segment:
        return segment
    return unquote_to_bytes(segment).decode("utf-8", "replace")


def remaining_segments(raw_target: str, consumed: int) -> tuple[list[str], str]:
    """Check the whole request target (path and query, as received) and return the raw path
    segments after the first `consumed` ones (the route's own: `u`, `{name}`...) and the raw
    query. Raises `UnsafePath`."""
    path, _, query = raw_target.partition("?")
    if "#" in raw_target:
        raise UnsafePath("request path: a '#' cannot be forwarded (fragments never reach an upstream)")
    if not path.startswith("/"):
        raise UnsafePath("request path: must start with '/'")
    if not _QUERY.fullmatch(query):
        raise UnsafePath(
            "query string: only RFC 3986 query characters are forwarded (percent-encode the rest)"
        )
    segments = path[1:].split("/")
    if not (_PLAIN_PATH.fullmatch(path) and "//" not in path and "/." not in path):
        last = len(segments) - 1
        for i, seg in enumerate(segments):
            _check_segment(seg, i == last)
    return segments[consumed:], query


def _check_segment(seg: str, last: bool) -> None:
    if not seg:
        if last:
            return  # a trailing slash
        raise UnsafePath("request path: empty segment ('//') — servers that merge slashes read another path")
    if not _SEGMENT.fullmatch(seg):
        raise UnsafePath(
            f"request path: segment {seg[:60]!r} has characters that must be percent-encoded "
            "(RFC 3986 path characters only)"
        )
    if "%" in seg:
        raw = unquote_to_bytes(seg)
        try:
            decoded = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise UnsafePath(f"request path: segment {seg[:60]!r} is not UTF-8 once decoded") from None
        if _FORBIDDEN_DECODED.search(decoded):
            raise UnsafePath(
                f"request path: segment {seg[:60]!r} encodes '/', '?', '#', '\\\\', '%', ';' or a control "
                "character; runcap does not forward paths an upstream could split differently"
            )
    else:
        decoded = seg
    if ";" in decoded:
        raise UnsafePath(
            f"request path: segment {seg[:60]!r} has a ';' — servers that read path parameters "
            "would serve another path than the one runcap checked"
        )
    if decoded in (".", ".."):
        raise UnsafePath(
            f"request path: dot segment {seg[:60]!r} (plain or encoded) — paths cannot leave "
            "the configured base path"
        )

