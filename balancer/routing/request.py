"""Parse a request body once, for routing and accounting only.

The proxy forwards the original bytes; nothing here is ever serialized back. Only the fields
routing needs are checked: deeper validation is the replica's job, and its answer passes
through unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import orjson
from xxhash import xxh3_64_hexdigest

from balancer.errors import ClientError
from policies.base import RequestFeatures

# Routes whose OpenAI contract makes `model` mandatory; SGLang's /generate has no model field.
MODEL_REQUIRED_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})
# orjson refuses numbers past a double's range (1e400, or over 309 digits), which JSON allows
# and the engines' parser (Python's json) reads. Its only refusal for a number's size.
NUMBER_RANGE_ERROR = "number is infinity when parsed as double"
# orjson reads integers past 64 bits as floats; the fallback reads them alike, so a body
# routes the same whichever parser read it.
INT_RANGE = range(-(1 << 63), 1 << 64)


def parse_json_object(body: bytes) -> dict[str, Any]:
    if not body:
        raise ClientError(400, "request body is empty; expected a JSON object", "invalid_json")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as utf_exc:
            raise ClientError(
                400, f"request body is not valid UTF-8 (byte {utf_exc.start})", "invalid_encoding"
            ) from None
        if not exc.msg.startswith(NUMBER_RANGE_ERROR):
            raise ClientError(400, f"request body is not valid JSON: {exc}", "invalid_json") from None
        data = _loads_wide_numbers(text)
    if not isinstance(data, dict):
        kind = _JSON_KINDS.get(type(data), "a number")
        raise ClientError(400, f"request body must be a JSON object, got {kind}", "invalid_json")
    return data


# The client wrote JSON, so its error names JSON's kinds, not Python's (null, not NoneType).
_JSON_KINDS = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}


def _loads_wide_numbers(text: str) -> Any:
    """The body orjson refused only for a number's size, read by the json module, which is
    as strict as orjson otherwise: what orjson would refuse further on is refused here."""
    try:
        data = json.loads(text, parse_int=_int, parse_constant=_no_constant)
    except ValueError as exc:  # json.JSONDecodeError and _no_constant's
        raise ClientError(400, f"request body is not valid JSON: {exc}", "invalid_json") from None
    except RecursionError:
        raise ClientError(400, "request body is not valid JSON: nested too deeply", "invalid_json") from None
    _refuse_lone_surrogates(data)
    return data


def _int(digits: str) -> int | float:
    # Short ones only: int() refuses over 4,300 digits (Python's guard against slow parsing),
    # and no integer in INT_RANGE has over 20 and a sign.
    if len(digits) <= 21:
        value = int(digits)
        if value in INT_RANGE:
            return value
    return float(digits)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _refuse_lone_surrogates(data: Any) -> None:
    """json reads an escaped half of a surrogate pair ("\\ud800") as a string no UTF-8 can
    encode; orjson refuses it, and so must this."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, value in item.items():
                stack.append(key)
                stack.append(value)
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str) and not item.isascii():
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ClientError(
                    400, f"request body is not valid JSON: lone surrogate \\u{ord(item[exc.start]):x} in a string",
                    "invalid_json",
                ) from None


PromptOf = Callable[[str, Mapping[str, Any]], Any]


def parse_request(
    route: str, body: bytes, session_header: str | None, *, with_prompt: bool = False,
    prompt_of: PromptOf | None = None,
) -> RequestFeatures:
    """`session_header` is the value of the `x-session-id` header, if any. The prompt is
    `canonical_prompt`'s text unless `prompt_of` says otherwise (precise mode's token ids)."""
    data = parse_json_object(body)
    model = data.get("model")
    if model is None:
        if route in MODEL_REQUIRED_ROUTES:
            raise ClientError(
                400, "you must provide a model parameter", "missing_model", param="model"
            )
    elif not isinstance(model, str) or not model:
        raise ClientError(400, "model must be a non-empty string", "invalid_model", param="model")

    session_key = session_header
    if not session_key:
        user = data.get("user")
        session_key = user if isinstance(user, str) and user else None

    max_tokens = data.get("max_completion_tokens", data.get("max_tokens"))
    if route == "/generate" and isinstance(sampling := data.get("sampling_params"), dict):
        max_tokens = sampling.get("max_new_tokens")
    adapter = lora_path_adapter(data.get("lora_path"))
    if adapter is not None and (model is None or ":" not in model):
        # SGLang's `lora_path` (its /generate's way, also read by its OpenAI routes, where a
        # BASE:ADAPTER model wins): routed, keyed and counted as that BASE:ADAPTER spelling.
        model = adapter if model is None else f"{model}:{adapter}"
    return RequestFeatures(
        route=route,
        model=model,
        stream=data.get("stream") is True,
        session_key=session_key,
        prompt=(prompt_of or canonical_prompt)(route, data) if with_prompt else None,
        # A bad value is the replica's to refuse; for routing it is just not a bound.
        max_tokens=max_tokens if type(max_tokens) is int and max_tokens >= 0 else None,
    )


def lora_path_adapter(lora_path: Any) -> str | None:
    """The LoRA adapter SGLang's `lora_path` names: a registered adapter's
    name, or one per prompt of a batch. A batch whose prompts all name one adapter runs
    under it. None for the base model, and for a batch that mixes adapters (or adapters and
    the base): it routes as the base model's, and the replica refuses what it cannot serve."""
    if isinstance(lora_path, str):
        return lora_path or None
    if isinstance(lora_path, list) and lora_path:
        first = lora_path[0]
        if isinstance(first, str) and first and all(item == first for item in lora_path):
            return first
    return None


def canonical_prompt(route: str, data: Mapping[str, Any]) -> str | list[int]:
    """The prompt as one string, built the same way every time so equal prefixes stay equal.

    Chat messages are flattened in order as role marker then content, tools first since
    templates put them in the system preamble.
    """
    if route == "/v1/chat/completions":
        parts: list[str] = []
        tools = data.get("tools")
        if tools:
            try:
                parts.append("<|tools|>" + orjson.dumps(tools, option=orjson.OPT_SORT_KEYS).decode())
            except orjson.JSONEncodeError:
                parts.append("<|tools|>")  # nested past orjson's depth limit: the replica will refuse it
        messages = data.get("messages")
        for message in messages if isinstance(messages, list) else ():
            if isinstance(message, Mapping):
                parts.append(f"<|{message.get('role', '')}|>{_text_of(message.get('content'))}")
        return "\n".join(parts)
    if route == "/generate":
        ids = data.get("input_ids")
        if "text" not in data and isinstance(ids, list) and all(
            isinstance(i, int) and 0 <= i < 1 << 32 for i in ids
        ):
            return ids  # hashed by token blocks, as the engine caches them
        return _text_of(data.get("text"))
    if route == "/v1/embeddings":
        return _text_of(data.get("input"))
    return _text_of(data.get("prompt"))


def answer_continuation(route: str, answer: str) -> str | None:
    """What follows a prompt's canonical text in the next prompt of its conversation, which
    sends `answer` back: a chat's next messages hold it as the assistant's, a completion's
    next prompt (and SGLang's /generate text) goes on from it. None for routes whose answers
    never come back as prompts."""
    if route == "/v1/chat/completions":
        return "\n<|assistant|>" + answer
    if route in ("/v1/completions", "/generate"):
        return answer
    return None


# Prompts nest at most twice (a batch of token-id lists); deeper structures are not prompts
# and are left for the replica to refuse, not walked (a deep one would exhaust the stack).
MAX_PROMPT_NESTING = 4


def _text_of(content: Any, depth: int = 0) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        if depth >= MAX_PROMPT_NESTING:
            return ""
        # Content parts ({"type": "text", "text": ...}), batched prompts, or token ids.
        return "\n".join(
            (_text_of(part.get("text"), depth + 1) if "text" in part else _media_of(part))
            if isinstance(part, Mapping) else _text_of(part, depth + 1)
            for part in content
        )
    if isinstance(content, Mapping):
        return ""
    return str(content)


def _media_of(part: Mapping[str, Any]) -> str:
    """An image or audio part, as a digest of the whole part: engines key their prefix cache
    on the media too, so two prompts that differ only in an image share nothing from it on,
    and the same image sent again is the same prefix."""
    try:
        whole = orjson.dumps(part, option=orjson.OPT_SORT_KEYS)
    except (orjson.JSONEncodeError, TypeError):
        return ""
    return f"<|{part.get('type', '')}|>{xxh3_64_hexdigest(whole)}"
