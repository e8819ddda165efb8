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


def sglang_body(body: bytes, prefill_url: str, bootstrap_port: int, room: int) -> bytes:
    host = urlsplit(prefill_url).hostname or "127.0.0.1"
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
