"""Response bodies in the shapes vLLM (OpenAI routes) and SGLang (`/generate`) send.

Streaming writes one chunk per token and dominates the replica's CPU, so the OpenAI chunks are
assembled from bytes prepared once per request and once per filler word rather than
serialized from dicts each time.
"""

from __future__ import annotations

from typing import Any

import orjson

from loadtest.replica.tokens import FILLER_WORDS, output_piece, output_text

DONE = b"data: [DONE]\n\n"


def http_chunk(payload: bytes) -> bytes:
    """One HTTP/1.1 chunk, for writes that bypass aiohttp's writer (see streaming.py)."""
    return b"%x\r\n%b\r\n" % (len(payload), payload)


FILLER_COUNT = len(FILLER_WORDS)
_FIRST_PIECE_JSON = orjson.dumps(FILLER_WORDS[0])
_SPACED_PIECES_JSON = tuple(orjson.dumps(" " + word) for word in FILLER_WORDS)


def _piece_json(index: int) -> bytes:
    if index == 0:
        return _FIRST_PIECE_JSON
    return _SPACED_PIECES_JSON[index % FILLER_COUNT]


def sse(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class OpenAIStream:
    """SSE chunks of one `/v1/chat/completions` or `/v1/completions` stream."""

    __slots__ = ("_head", "_first", "_rest", "_envelope", "_framed")

    def __init__(
        self, chat: bool, request_id: str, created: int, model: str, max_tokens: int = 0
    ) -> None:
        obj = "chat.completion.chunk" if chat else "text_completion"
        self._envelope = {"id": request_id, "object": obj, "created": created, "model": model}
        head = (
            b'data: {"id":' + orjson.dumps(request_id) + b',"object":"' + obj.encode()
            + b'","created":' + str(created).encode() + b',"model":' + orjson.dumps(model)
            + b',"choices":[{"index":0,'
        )  # fmt: skip
        if chat:
            self._head = head + b'"delta":{"content":'
            self._first = head + b'"delta":{"role":"assistant","content":'
            self._rest = b'},"logprobs":null,"finish_reason":'
        else:
            self._head = self._first = head + b'"text":'
            self._rest = b',"logprobs":null,"finish_reason":'
        # A middle chunk (neither the first, which carries the role, nor the last, which
        # carries the finish reason) depends only on its filler word: slot i holds the chunk
        # of tokens i, i + FILLER_COUNT, ... Those a stream of `max_tokens` needs are built
        # here, in the handler, rather than one at a time in the engine loop (streaming.py).
        self._framed: list[bytes | None] = [None] * FILLER_COUNT
        for index in range(1, min(max_tokens - 1, FILLER_COUNT + 1)):
            self._framed[index % FILLER_COUNT] = http_chunk(self.token_chunk(index, False))

    def token_chunk(self, index: int, last: bool) -> bytes:
        head = self._first if index == 0 else self._head
        reason = b'"length"}]}\n\n' if last else b"null}]}\n\n"
        return head + _piece_json(index) + self._rest + reason

    def framed_chunk(self, index: int) -> bytes:
        """`token_chunk(index, last=False)` framed as one HTTP/1.1 chunk."""
        if not index:  # the first chunk also carries the role; never repeated
            return http_chunk(self.token_chunk(0, False))
        slot = index % FILLER_COUNT
        framed = self._framed[slot]
        if framed is None:
            framed = self._framed[slot] = http_chunk(self.token_chunk(index, False))
        return framed

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> bytes:
        payload = dict(self._envelope)
        payload["choices"] = []
        payload["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
        return sse(payload)


def chat_completion(
    request_id: str,
    created: int,
    model: str,
    completion_tokens: int,
    usage_body: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> bytes:
    """`extra`: top-level fields beside the usual ones (vLLM's `kv_transfer_params`)."""
    return orjson.dumps(
        {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": output_text(completion_tokens)},
                    "logprobs": None,
                    "finish_reason": "length",
                }
            ],
            "usage": usage_body,
            **(extra or {}),
        }
    )


def text_completion(
    request_id: str,
    created: int,
    model: str,
    completion_tokens: int,
    usage_body: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> bytes:
    return orjson.dumps(
        {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "text": output_text(completion_tokens),
                    "logprobs": None,
                    "finish_reason": "length",
                }
            ],
            "usage": usage_body,
            **(extra or {}),
        }
    )


class SGLangGenerate:
    """`/generate` bodies; a stream sends the text so far in every chunk, as SGLang does."""

    __slots__ = ("_rid", "_prompt_tokens", "cached_tokens", "_text")

    def __init__(self, rid: str, prompt_tokens: int, cached_tokens: int = 0) -> None:
        self._rid = rid
        self._prompt_tokens = prompt_tokens
        # Known once the engine admits the request; the handler sets it before rendering.
        self.cached_tokens = cached_tokens
        self._text = ""

    def _body(self, text: str, completion_tokens: int, finished: bool, latency_s: float | None):
        meta: dict[str, Any] = {
            "id": self._rid,
            "finish_reason": {"type": "length", "length": completion_tokens} if finished else None,
            "prompt_tokens": self._prompt_tokens,
            "completion_tokens": completion_tokens,
            "cached_tokens": self.cached_tokens,
        }
        if latency_s is not None:
            meta["e2e_latency"] = latency_s
        return {"text": text, "meta_info": meta}

    def stream_chunk(self, index: int, finished: bool, latency_s: float | None) -> bytes:
        self._text += output_piece(index)
        return sse(self._body(self._text, index + 1, finished, latency_s))

    def framed_chunk(self, index: int) -> bytes:
        return http_chunk(self.stream_chunk(index, False, None))

    def response(self, completion_tokens: int, latency_s: float) -> bytes:
        return orjson.dumps(
            self._body(output_text(completion_tokens), completion_tokens, True, latency_s)
        )
