"""What the request path hands its records to: `SpanRecorder`.

The request path (model calls, `/tools` calls) builds `Span`s, `RunSnapshot`s and payload bodies
and gives them to a recorder, which must return at once (it queues; it never does I/O on the
event loop). `PipelineRecorder` feeds the span pipeline; `NullRecorder` drops everything, for a
runcap configured without a span store.
"""

from __future__ import annotations

import hashlib
from typing import Protocol

from proxy.spans.model import Payload, RunSnapshot, Span
from proxy.spans.payloads import PayloadPolicy
from proxy.spans.pipeline import SpanPipeline


class SpanRecorder(Protocol):
    def span(self, span: Span) -> None: ...

    def run(self, snapshot: RunSnapshot) -> None: ...

    def payload(self, data: bytes, *, is_error: bool = False, content_type: str = "") -> str:
        """Queue a body for the payload store; return its sha256 hex ('' when not stored:
        payloads off, errors-only and this is no error, or over the size limit)."""


class NullRecorder:
    def span(self, span: Span) -> None:
        pass

    def run(self, snapshot: RunSnapshot) -> None:
        pass

    def payload(self, data: bytes, *, is_error: bool = False, content_type: str = "") -> str:
        return ""


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class PipelineRecorder:
    """Feeds the span pipeline; payload bodies are hashed here (the hash goes in the span) and
    kept only when the payload policy says so."""

    def __init__(self, pipeline: SpanPipeline, policy: PayloadPolicy) -> None:
        self.pipeline = pipeline
        self.policy = policy

    def span(self, span: Span) -> None:
        self.pipeline.submit_span(span)

    def run(self, snapshot: RunSnapshot) -> None:
        self.pipeline.submit_run(snapshot)

    def payload(self, data: bytes, *, is_error: bool = False, content_type: str = "") -> str:
        if not self.policy.keep(is_error, len(data)):
            return ""
        digest = sha256_hex(data)
        self.pipeline.submit_payload(Payload(digest, data, content_type))
        return digest
