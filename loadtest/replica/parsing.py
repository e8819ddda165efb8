"""Request bodies of the three generation routes, checked and reduced to what the engine needs.

Every malformed body becomes an `ApiError` (HTTP 400) here, so the handlers never meet a
shape they did not expect and nothing reaches a 500. Sampling fields the simulator cannot
honour (temperature, top_p, stop, ...) are type-checked where cheap and otherwise ignored, as
the output is filler anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from loadtest.replica.tokens import PromptError, chat_tokens, id_tokens, text_tokens


class ApiError(Exception):
    """An error answered in the OpenAI shape: {"error": {"message", "type", "code", "param"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | int,
        type_: str = "invalid_request_error",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.type = type_
        self.param = param

    def body(self) -> bytes:
        return orjson.dumps(
            {
                "error": {
                    "message": self.message,
                    "type": self.type,
                    "param": self.param,
                    "code": self.code,
                }
            }
        )


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code, param=param)


def model_not_found(model: str) -> ApiError:
    # vLLM's own body, the status as the code, so clients that tell a missing adapter from
    # other errors by it work here.
    return ApiError(
        404, f"The model `{model}` does not exist.", 404, type_="NotFoundError", param="model"
    )


@dataclass(slots=True)
class GenerationRequest:
    route: str  # "chat", "completion" or "generate"
    tokens: list[str]
    max_tokens: int | None  # None: the server's default, clamped to the context left
    stream: bool
    include_usage: bool
    model: str | None
    request_id: str | None = None
    lora_path: str | None = None  # SGLang's /generate: the name of a registered adapter


async def read_body(request: web.Request, max_body_bytes: int) -> bytes:
    """The request's body, or a 413 in the OpenAI error shape past the configured limit."""
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"request body exceeds {max_body_bytes} bytes", "request_too_large") from None


def parse_json_object(body: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise bad_request(f"request body is not valid JSON: {error}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    return data


def _optional_bool(data: dict[str, Any], key: str, default: bool = False) -> bool:
    value = data.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{key}' must be a boolean", param=key)
    return value


def _optional_positive_int(data: dict[str, Any], key: str) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise bad_request(f"'{key}' must be a positive integer", param=key)
    return value


def _optional_number(data: dict[str, Any], key: str) -> None:
    value = data.get(key)
    if value is not None and (not isinstance(value, int | float) or isinstance(value, bool)):
        raise bad_request(f"'{key}' must be a number", param=key)


def _model(data: dict[str, Any]) -> str | None:
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", param="model")
    return model


def _openai_common(data: dict[str, Any]) -> tuple[bool, bool, str | None]:
    for key in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        _optional_number(data, key)
    n = data.get("n")
    if n is not None and n != 1:
        raise bad_request("only n=1 is supported", param="n")
    stream = _optional_bool(data, "stream")
    options = data.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request("'stream_options' must be an object", param="stream_options")
        include_usage = _optional_bool(options, "include_usage")
    return stream, include_usage, _model(data)


def parse_chat(data: dict[str, Any]) -> GenerationRequest:
    if "messages" not in data:
        raise bad_request(
            "'messages' is required", param="messages", code="missing_required_parameter"
        )
    try:
        tokens = chat_tokens(data["messages"])
    except PromptError as error:
        raise bad_request(str(error), param="messages") from None
    stream, include_usage, model = _openai_common(data)
    max_tokens = _optional_positive_int(data, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _optional_positive_int(data, "max_tokens")
    return GenerationRequest("chat", tokens, max_tokens, stream, include_usage, model)


def parse_completion(data: dict[str, Any]) -> GenerationRequest:
    if "prompt" not in data:
        raise bad_request("'prompt' is required", param="prompt", code="missing_required_parameter")
    prompt = data["prompt"]
    # The OpenAI API also takes a batch (a list of prompts); one prompt per request here.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    try:
        if isinstance(prompt, str):
            tokens = text_tokens(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            tokens = id_tokens(prompt)
        else:
            raise PromptError("'prompt' must be a string or a list of token ids (no batches)")
    except PromptError as error:
        raise bad_request(str(error), param="prompt") from None
    if not tokens:
        raise bad_request("'prompt' is empty", param="prompt")
    stream, include_usage, model = _openai_common(data)
    max_tokens = _optional_positive_int(data, "max_tokens")
    return GenerationRequest("completion", tokens, max_tokens, stream, include_usage, model)


def parse_generate(data: dict[str, Any]) -> GenerationRequest:
    text = data.get("text")
    input_ids = data.get("input_ids")
    if (text is None) == (input_ids is None):
        raise bad_request("give exactly one of 'text' and 'input_ids'", param="text")
    try:
        if text is not None:
            if not isinstance(text, str):
                raise PromptError("'text' must be a string (batches are not supported)")
            tokens = text_tokens(text)
        else:
            if not isinstance(input_ids, list):
                raise PromptError("'input_ids' must be a list of token ids")
            tokens = id_tokens(input_ids)
    except PromptError as error:
        raise bad_request(str(error), param="text" if text is not None else "input_ids") from None
    if not tokens:
        raise bad_request("the prompt is empty", param="text")
    params = data.get("sampling_params")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise bad_request("'sampling_params' must be an object", param="sampling_params")
    for key in ("temperature", "top_p"):
        _optional_number(params, key)
    max_tokens = _optional_positive_int(params, "max_new_tokens")
    rid = data.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise bad_request("'rid' must be a string", param="rid")
    lora_path = data.get("lora_path")
    if lora_path is not None and not isinstance(lora_path, str):
        raise bad_request(
            "'lora_path' must be a string (batches are not supported)", param="lora_path"
        )
    stream = _optional_bool(data, "stream")
    return GenerationRequest(
        "generate", tokens, max_tokens, stream, False, _model(data), rid, lora_path
    )
