"""The URL builder (proxy/upstream_url.py) on its own: each refusal with the message that
names what was refused (long segments cut at 60 characters), the trailing slash it allows on
every path, and how a base URL is split and extended. The trust-boundary tests drive it through
runcap; these pin what the mutation run of issue 28 found them not to (docs/mutation.md)."""

from __future__ import annotations

import pytest

from proxy.upstream_url import Base, UnsafePath, decode_segment, remaining_segments

LONG = "a" * 70  # longer than the 60 characters a message quotes

REFUSED = [
    ("/v1/x#frag", "request path: a '#' cannot be forwarded (fragments never reach an upstream)"),
    ("v1/chat", "request path: must start with '/'"),
    (
        "/v1/chat?q=a b",
        "query string: only RFC 3986 query characters are forwarded (percent-encode the rest)",
    ),
    ("/v1//chat", "request path: empty segment ('//') — servers that merge slashes read another path"),
    (
        f"/v1/{LONG} b",
        f"request path: segment {(LONG + ' b')[:60]!r} has characters that must be percent-encoded "
        "(RFC 3986 path characters only)",
    ),
    (f"/v1/%ff{LONG}", f"request path: segment {('%ff' + LONG)[:60]!r} is not UTF-8 once decoded"),
    (
        f"/v1/%2F{LONG}",
        f"request path: segment {('%2F' + LONG)[:60]!r} encodes '/', '?', '#', '\\\\', '%', ';' or a "
        "control character; runcap does not forward paths an upstream could split differently",
    ),
    (
        f"/v1/{LONG};x",
        f"request path: segment {(LONG + ';x')[:60]!r} has a ';' — servers that read path parameters "
        "would serve another path than the one runcap checked",
    ),
    (
        "/v1/./chat",
        "request path: dot segment '.' (plain or encoded) — paths cannot leave the configured base path",
    ),
    (
        "/v1/%2e%2E/chat",
        "request path: dot segment '%2e%2E' (plain or encoded) — paths cannot leave the configured base path",
    ),
]


@pytest.mark.parametrize(("raw", "message"), REFUSED, ids=[r for r, _ in REFUSED])
def test_each_refusal_names_what_it_refused(raw: str, message: str) -> None:
    with pytest.raises(UnsafePath) as e:
        remaining_segments(raw, 1)
    assert (e.value.message, e.value.param, e.value.status) == (message, "path", 400)


def test_a_trailing_slash_is_allowed_on_the_checked_path_too() -> None:
    assert remaining_segments("/v1/chat/", 1) == (["chat", ""], "")  # the plain path's fast check
    assert remaining_segments("/v1/%41/", 1) == (["%41", ""], "")  # the segment by segment check
    assert remaining_segments("/v1/%41/x?a=1&b=/?", 1) == (["%41", "x"], "a=1&b=/?")
    with pytest.raises(UnsafePath, match="empty segment"):
        remaining_segments("/v1/%41//", 1)


def test_decode_segment() -> None:
    assert decode_segment("messages") == "messages"
    assert decode_segment("%2e%2E") == ".."
    assert decode_segment("caf%C3%A9") == "café"
    assert decode_segment("%ff") == "\ufffd"  # undecodable bytes are replaced, never raised


def test_a_base_is_split_once_and_extended_without_concatenation() -> None:
    base = Base.parse("https://h.test:8443/base%20dir/api/")
    assert (base.origin, base.raw_path, base.path) == (
        "https://h.test:8443",
        "/base%20dir/api",
        "/base dir/api",
    )
    assert Base.parse("http://h.test/X/").raw_path == "/X"
    assert Base.parse("http://h.test/a b/%41").path == "/a b/A"
    for bare in ("http://h.test", "http://h.test/"):
        b = Base.parse(bare)
        assert (b.raw_path, b.path) == ("", "")
        root = b.target([], "")
        assert (str(root.url), root.path, root.query, root.path_qs) == ("http://h.test", "/", "", "/")

    t = base.target(["v1", "chat%2Dx"], "a=1")
    assert str(t.url) == "https://h.test:8443/base%20dir/api/v1/chat%2Dx?a=1"
    assert (t.path, t.query, t.path_qs) == ("/base dir/api/v1/chat-x", "a=1", "/base dir/api/v1/chat-x?a=1")
    bare = base.target([], "")
    assert str(bare.url) == "https://h.test:8443/base%20dir/api" and bare.path == "/base dir/api"
    assert "?" not in str(base.target(["v1"], "").url)
