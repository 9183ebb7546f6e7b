"""Canonical JSON and the hashes DESIGN.md fixes ("Hashes", "Idempotent tool calls"), against
values computed here from the rules as written — not from runcap's own functions."""

from __future__ import annotations

import hashlib

import pytest

from proxy.hashing import args_hash, canonical_json, idempotency_key, parse_json, result_hash


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_canonical_json_is_sorted_compact_utf8_with_integral_floats_as_integers() -> None:
    assert canonical_json({"b": 1, "a": 2.0}) == b'{"a":2,"b":1}' == canonical_json({"a": 2, "b": 1})
    assert canonical_json({"z": [1.0, 1.5, -0.0, (3.0, "é")], 7: None}) == (
        '{"7":null,"z":[1,1.5,0,[3,"é"]]}'.encode()
    )
    assert canonical_json("日本") == '"日本"'.encode()  # ensure_ascii=False, UTF-8
    assert canonical_json({"n": {"m": 2.0}}) == b'{"n":{"m":2}}'
    assert canonical_json(1e300) == str(int(1e300)).encode()  # integral, however large
    assert canonical_json(1.5e-7) == b"1.5e-07" and canonical_json(True) == b"true"
    for bad in (float("nan"), float("inf"), {"x": float("-inf")}):
        with pytest.raises(ValueError):
            canonical_json(bad)
    deep: list[object] = []
    for _ in range(5_000):
        deep = [deep]
    with pytest.raises(ValueError, match=r"^nested too deep to canonicalise$"):
        canonical_json(deep)


def test_parse_json() -> None:
    assert parse_json(b'{"a": 1}') == (True, {"a": 1})
    assert parse_json("[1, 2]") == (True, [1, 2])
    for bad in (b"{", b"\xff", "nope", b"[" * 5_000 + b"]" * 5_000):
        assert parse_json(bad) == (False, None)


def test_args_and_result_hashes() -> None:
    assert args_hash(b'{"b": 1, "a": 2.0}') == sha(b'{"a":2,"b":1}') == args_hash('{"a":2,"b":1}')
    assert args_hash(b"not json") == sha(b"not json") == args_hash("not json")
    assert args_hash("caf\u00e9 is not json") == sha("café is not json".encode())
    assert args_hash(b'{"x": NaN}') == sha(b'{"x": NaN}')  # parses, but has no canonical form
    assert result_hash(b'{"ok": 1.0}') == sha(b'{"ok":1}')
    assert result_hash(b"plain text") == sha(b"plain text")


def test_idempotency_key_is_the_first_32_hex_of_the_canonical_document() -> None:
    doc = b'{"args":{"amount":5,"order_id":"A1"},"op":null,"run":"r1","tool":"refund"}'
    key = idempotency_key("r1", "refund", {"order_id": "A1", "amount": 5.0}, None)
    assert key == sha(doc)[:32] and len(key) == 32
    with_op = b'{"args":{"amount":5,"order_id":"A1"},"op":"second","run":"r1","tool":"refund"}'
    assert idempotency_key("r1", "refund", {"order_id": "A1", "amount": 5}, "second") == sha(with_op)[:32]
    assert idempotency_key("r2", "refund", {"order_id": "A1", "amount": 5}, None) != key
