"""Reading what a replica says it had cached, from answers that pass through untouched.

OpenAI routes (vLLM, SGLang): `usage.prompt_tokens` and
`usage.prompt_tokens_details.cached_tokens`, in the body or, when streaming, in the final
chunk if the client asked for `stream_options.include_usage`. SGLang's /generate:
`meta_info.prompt_tokens` and `meta_info.cached_tokens`, in every event.
Learning is best effort: what cannot be read is skipped, never an error for the client.
"""

from __future__ import annotations

from typing import Any

import orjson

CACHED_MARK = b'"cached_tokens"'


def usage_of(payload: Any) -> tuple[int, int] | None:
    """(prompt tokens, cached tokens) from a parsed answer or event, if it carries them."""
    if not isinstance(payload, dict):
        return None
    usage = payload.get("usage")
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        prompt = usage.get("prompt_tokens")
    else:
        meta = payload.get("meta_info")
        if not isinstance(meta, dict):
            return None
        cached, prompt = meta.get("cached_tokens"), meta.get("prompt_tokens")
    if isinstance(prompt, int) and isinstance(cached, int) and prompt > 0:
        return prompt, cached
    return None


def usage_from_body(body: bytes) -> tuple[int, int] | None:
    if CACHED_MARK not in body:
        return None
    try:
        return usage_of(orjson.loads(body))
    except orjson.JSONDecodeError:
        return None


def usage_from_sse(chunk: bytes) -> tuple[int, int] | None:
    """From the first whole `data:` event in `chunk` that carries cached tokens."""
    if CACHED_MARK not in chunk:
        return None
    for line in chunk.split(b"\n"):
        if line.startswith(b"data:") and CACHED_MARK in line:
            try:
                found = usage_of(orjson.loads(line[5:]))
            except orjson.JSONDecodeError:
                continue  # an event cut across chunks: skip it
            if found is not None:
                return found
    return None
