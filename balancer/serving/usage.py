"""Reading what a replica says it had cached, and the token counts of an answer, from
answers that pass through untouched.

OpenAI routes (vLLM, SGLang): `usage.prompt_tokens` and
`usage.prompt_tokens_details.cached_tokens`, in the body or, when streaming, in the final
chunk if the client asked for `stream_options.include_usage`. SGLang's /generate:
`meta_info.prompt_tokens` and `meta_info.cached_tokens`, in every event. The prompt count
alone still teaches tokens per character: engines report cached tokens only when told to
(vLLM's `--enable-prompt-tokens-details`, SGLang's `--enable-cache-report`).
Learning is best effort: what cannot be read is skipped, never an error for the client.

The access log's token counts (prompt, cached, output: `usage.completion_tokens` or
`meta_info.completion_tokens`) come from the same objects. The proxy reads them only while the
access log is on, parses a body only when it contains `"usage"` or `"meta_info"`, and of a
stream parses only the last chunk with one of those marks (the final usage chunk, or SGLang's
last event, which has the final counts), once the stream has ended.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

PROMPT_MARK = b'"prompt_tokens"'
USAGE_MARK = b'"usage"'
META_MARK = b'"meta_info"'


@dataclass(frozen=True, slots=True)
class TokenCounts:
    """An answer's token counts as its replica reported them; None where it did not say."""

    prompt: int | None
    cached: int | None
    output: int | None


def has_usage(data: bytes) -> bool:
    return USAGE_MARK in data or META_MARK in data


def parse_json(body: bytes) -> Any:
    """The parsed body, or None when it is not JSON."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def counts_of(payload: Any) -> TokenCounts | None:
    """The token counts of a parsed answer or event, if it carries any."""
    if not isinstance(payload, dict):
        return None
    usage = payload.get("usage")
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        prompt, output = usage.get("prompt_tokens"), usage.get("completion_tokens")
    else:
        meta = payload.get("meta_info")
        if not isinstance(meta, dict):
            return None
        prompt, cached, output = meta.get("prompt_tokens"), meta.get("cached_tokens"), meta.get("completion_tokens")
    counts = TokenCounts(_int_or_none(prompt), _int_or_none(cached), _int_or_none(output))
    return None if counts == TokenCounts(None, None, None) else counts


def counts_from_sse(chunk: bytes, mark: bytes | None = None) -> TokenCounts | None:
    """From the last whole `data:` event in `chunk` that carries token counts (and `mark`,
    when given)."""
    for line in reversed(chunk.split(b"\n")):
        if line.startswith(b"data:") and has_usage(line) and (mark is None or mark in line):
            try:
                found = counts_of(orjson.loads(line[5:]))
            except orjson.JSONDecodeError:
                continue  # an event cut across chunks: skip it
            if found is not None:
                return found
    return None


def learnable(counts: TokenCounts | None) -> tuple[int, int | None] | None:
    """(prompt tokens, cached tokens or None) when the replica reported the prompt's."""
    if counts is None or counts.prompt is None or counts.prompt <= 0:
        return None
    return counts.prompt, counts.cached


def usage_from_sse(chunk: bytes) -> tuple[int, int | None] | None:
    """(prompt tokens, cached tokens or None) from the events in `chunk` that carry a prompt
    count."""
    if PROMPT_MARK not in chunk:
        return None
    return learnable(counts_from_sse(chunk, PROMPT_MARK))
