"""Token counting of the scripted upstream: deterministic, so that tests can assert exact usage.

Output is counted as ceil(UTF-8 bytes / 4) (`count_tokens`, `filler_text`, `truncate_to_tokens`);
input by an `InputTokenizer`, per wire format (`chat_input_tokens`, `responses_input_tokens`,
`anthropic_input_tokens`, `prompt_tokens` for legacy prompts and embeddings inputs), plus what the
providers bill beyond the text: inputs by reference and input audio.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

BASE_INPUT_TOKENS = 3
TOKENS_PER_MESSAGE = 4
TOKENS_PER_IMAGE = 85

# Filler for `text_tokens` steps: ASCII, so N tokens are exactly 4*N bytes.
_FILLER_UNIT = "lorem ipsum dolor sit amet, consectetur adipiscing elit; sed do eiusmod tempor. "
_FILLER = _FILLER_UNIT * 200


def count_tokens(text: str) -> int:
    """Tokens of `text` as this server counts them: ceil(UTF-8 bytes / 4)."""
    return (len(text.encode()) + 3) // 4


def filler_text(tokens: int) -> str:
    """Text of exactly `tokens` tokens (by `count_tokens`)."""
    n = 4 * tokens
    if n <= len(_FILLER):
        return _FILLER[:n]
    return (_FILLER * (n // len(_FILLER) + 1))[:n]


def truncate_to_tokens(text: str, tokens: int) -> str:
    """The longest prefix of `text` (on a character boundary) within `tokens` tokens."""
    return text.encode()[: 4 * tokens].decode(errors="ignore")


# --------------------------------------------------------------------------- input counting


def _text_of(content: Any, parts: list[str]) -> int:
    """Append the text of message content to `parts`; return the image count."""
    if content is None:
        return 0
    if isinstance(content, str):
        parts.append(content)
        return 0
    images = 0
    if isinstance(content, list):
        for block in content:
            if isinstance(block, str):
                parts.append(block)
            elif isinstance(block, dict):
                kind = block.get("type")
                if isinstance(block.get("text"), str):
                    parts.append(block["text"])
                elif kind in ("image", "image_url", "input_image"):
                    images += 1
                elif kind == "tool_use":
                    parts.append(block.get("name") or "")
                    parts.append(orjson.dumps(block.get("input") or {}).decode())
                elif kind == "tool_result":
                    images += _text_of(block.get("content"), parts)
    return images


@dataclass(frozen=True, slots=True)
class InputTokenizer:
    """How the server counts input tokens. The default — ceil(UTF-8 bytes / 4) of a message's
    text, 3 per request, 4 per message — is also runcap's own estimate. `per_word` counts every
    whitespace-separated word of each text part as ceil(bytes / `bytes_per_token`) tokens, at
    least one (tiktoken and SentencePiece never merge across the space between two words): with
    2 bytes a token it is denser than the estimate, with a large one it is one token a word."""

    bytes_per_token: int = 4
    per_word: bool = False
    base: int = BASE_INPUT_TOKENS
    per_message: int = TOKENS_PER_MESSAGE

    @classmethod
    def words(cls, bytes_per_token: int, *, base: int = 0, per_message: int = 0) -> InputTokenizer:
        return cls(bytes_per_token, per_word=True, base=base, per_message=per_message)

    def text(self, text: str) -> int:
        n = self.bytes_per_token
        if not self.per_word:
            return (len(text.encode()) + n - 1) // n
        return sum((len(word.encode()) + n - 1) // n for word in text.split())

    def message(self, parts: list[str], images: int) -> int:
        text = sum(self.text(p) for p in parts) if self.per_word else self.text("".join(parts))
        return self.per_message + text + TOKENS_PER_IMAGE * images

    def tools(self, tools: Any) -> int:
        return self.text(orjson.dumps(tools).decode()) if tools else 0


BYTES_4 = InputTokenizer()


def chat_input_tokens(body: dict[str, Any], tok: InputTokenizer = BYTES_4) -> int:
    total = tok.base + tok.tools(body.get("tools"))
    for msg in body.get("messages") or ():
        parts: list[str] = []
        images = _text_of(msg.get("content"), parts)
        for call in msg.get("tool_calls") or ():
            fn = call.get("function") or {}
            parts.append(fn.get("name") or "")
            parts.append(fn.get("arguments") or "")
        total += tok.message(parts, images)
    return total


def responses_input_tokens(body: dict[str, Any], tok: InputTokenizer = BYTES_4) -> int:
    total = tok.base + tok.tools(body.get("tools"))
    if body.get("instructions"):
        total += tok.message([body["instructions"]], 0)
    items = body.get("input")
    if isinstance(items, str):
        return total + tok.message([items], 0)
    for item in items or ():
        parts: list[str] = []
        images = 0
        kind = item.get("type")
        if kind == "function_call":
            parts.append(item.get("name") or "")
            parts.append(item.get("arguments") or "")
        elif kind == "function_call_output":
            images = _text_of(item.get("output"), parts)
        else:
            images = _text_of(item.get("content"), parts)
        total += tok.message(parts, images)
    return total


def anthropic_input_tokens(body: dict[str, Any], tok: InputTokenizer = BYTES_4) -> int:
    """All input tokens of a messages request (before splitting off cache reads and writes)."""
    total = tok.base + tok.tools(body.get("tools"))
    if body.get("system"):
        parts: list[str] = []
        _text_of(body["system"], parts)
        total += tok.message(parts, 0)
    for msg in body.get("messages") or ():
        parts = []
        images = _text_of(msg.get("content"), parts)
        total += tok.message(parts, images)
    return total


def prompt_tokens(value: Any) -> int:
    """Tokens of a legacy-completions prompt or an embeddings input (text or token arrays)."""
    if isinstance(value, str):
        return count_tokens(value)
    if isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):
            return len(value)
        return sum(prompt_tokens(v) for v in value)
    return 0


def references(body: Any) -> int:
    """Inputs by reference: a file by id (chat `file.file_id`, Responses `input_file` /
    `input_image` by `file_id` or `file_url`), an Anthropic document or image by URL or file."""
    if isinstance(body, list):
        return sum(references(v) for v in body)
    if not isinstance(body, dict):
        return 0
    kind = body.get("type")
    if kind == "file" and isinstance(body.get("file"), dict) and body["file"].get("file_id"):
        return 1
    if kind in ("input_file", "input_image") and (body.get("file_id") or body.get("file_url")):
        return 1
    source = body.get("source")
    if kind in ("document", "image") and isinstance(source, dict) and source.get("type") in ("url", "file"):
        return 1
    return sum(references(v) for v in body.values() if isinstance(v, list | dict))


def input_audio_tokens(body: Any) -> int:
    if isinstance(body, list):
        return sum(input_audio_tokens(v) for v in body)
    if not isinstance(body, dict):
        return 0
    if body.get("type") == "input_audio" and isinstance(body.get("input_audio"), dict):
        data = body["input_audio"].get("data")
        return len(data) // 3 if isinstance(data, str) else 0
    return sum(input_audio_tokens(v) for v in body.values() if isinstance(v, list | dict))
