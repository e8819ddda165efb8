"""The two wire protocols of prefill/decode disaggregation: the one place kvlb edits a body.

SGLang's (its router and mini_lb): the same body goes to the prefill and the decode server
at once, with `bootstrap_host`, `bootstrap_port` and `bootstrap_room` added; the decode
server fetches the KV from the prefill server's bootstrap server under that room, and its
answer is the client's.

vLLM's connector flow (its disaggregated-serving proxies for NIXL and P2P connectors): the
prefill request asks for remote decode (`kv_transfer_params.do_remote_decode`), one token,
no stream; its answer's `kv_transfer_params` then go with the client's request to the decode
server, whose answer is the client's.

What reaches the decode server is the client's body byte for byte with the fields added at
its start; a client that names one of them is refused (they are kvlb's to set). The vLLM
prefill request is rebuilt from the parsed body with its stream, token bound and
`stream_options` changed: its answer never reaches the client.
"""

from __future__ import annotations

import secrets
from typing import Any
from urllib.parse import urlsplit

import orjson

from balancer.errors import ClientError

SGLANG_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
# Rooms one disaggregated request may ask for (a batch, or `n` choices).
MAX_BATCH_ROOMS = 1024
VLLM_FIELD = "kv_transfer_params"
_WHITESPACE = b" \t\r\n"

PREFILL_KV_PARAMS = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}


def parse_object(body: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        data = None
    if not isinstance(data, dict):
        raise ClientError(400, "the request body must be a JSON object", "invalid_request")
    return data


def refuse_reserved(data: dict[str, Any], protocol: str) -> None:
    names = SGLANG_FIELDS if protocol == "sglang" else (VLLM_FIELD,)
    for name in names:
        if name in data:
            raise ClientError(400, f"'{name}' is set by the balancer for disaggregated serving",
                              "reserved_field", param=name)


def with_fields_first(body: bytes, fields: dict[str, Any]) -> bytes:
    """`body`, a JSON object, with `fields` added at its start and every other byte kept."""
    start = 0
    while start < len(body) and body[start] in _WHITESPACE:
        start += 1
    rest = body[start + 1:]
    added = orjson.dumps(fields)[1:-1]
    if rest.lstrip(_WHITESPACE).startswith(b"}"):
        return body[:start + 1] + added + rest
    return body[:start + 1] + added + b"," + rest


def new_room() -> int:
    return secrets.randbits(63)


def batch_size(data: dict[str, Any]) -> int | None:
    """How many sequences one request asks the engine for, as SGLang's router counts them
    to give each its own room: `n` above 1, or a list of prompts (`text` on /generate,
    `prompt` of strings or of token lists, `input_ids` of token lists). None: one. Refused
    beyond MAX_BATCH_ROOMS, since each room is a field kvlb writes."""
    size = None
    n = data.get("n")
    if type(n) is int and n > 1:
        size = n
    else:
        for key in ("text", "prompt", "input_ids"):
            value = data.get(key)
            if isinstance(value, list) and value and (key == "text" or not isinstance(value[0], int)):
                size = len(value)
                break
    if size is not None and size > MAX_BATCH_ROOMS:
        raise ClientError(400, f"a disaggregated request asks for at most {MAX_BATCH_ROOMS} sequences, "
                               f"this one for {size}", "batch_too_large")
    return size


def rooms_for(data: dict[str, Any]) -> int | list[int]:
    """A fresh room, or one per sequence of a batch."""
    size = batch_size(data)
    return new_room() if size is None else [new_room() for _ in range(size)]


def sglang_body(body: bytes, prefill_url: str, bootstrap_port: int, room: int | list[int]) -> bytes:
    """With a list of rooms (a batch), the host and port are lists of as many, as SGLang's
    router sends them: every version of SGLang reads those, where a single room for a batch
    is numbered on differently from one version to the next."""
    host = urlsplit(prefill_url).hostname or "127.0.0.1"
    if isinstance(room, list):
        return with_fields_first(body, {"bootstrap_host": [host] * len(room),
                                        "bootstrap_port": [bootstrap_port] * len(room), "bootstrap_room": room})
    return with_fields_first(body, {"bootstrap_host": host, "bootstrap_port": bootstrap_port,
                                    "bootstrap_room": room})


def vllm_prefill_body(data: dict[str, Any]) -> bytes:
    prefill = dict(data)
    prefill[VLLM_FIELD] = dict(PREFILL_KV_PARAMS)
    prefill["stream"] = False
    prefill.pop("stream_options", None)
    prefill["max_tokens"] = 1
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    return orjson.dumps(prefill)


def vllm_transfer_params(answer: bytes) -> dict[str, Any] | None:
    """The prefill answer's `kv_transfer_params`, for the decode request; None if absent."""
    try:
        data = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return None
    params = data.get(VLLM_FIELD) if isinstance(data, dict) else None
    return params if isinstance(params, dict) else None


def vllm_decode_body(body: bytes, params: dict[str, Any]) -> bytes:
    return with_fields_first(body, {VLLM_FIELD: params})
