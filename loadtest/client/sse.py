"""Reading OpenAI-style answers: server-sent event streams, usage blocks, errors."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson

MAX_ERROR_CHARS = 200


class StreamReader:
    """Follows one chat or text-completion stream, fed line by line with arrival times."""

    __slots__ = ("token_times", "content_chunks", "usage", "done", "error")

    def __init__(self) -> None:
        self.token_times: list[float] = []  # arrival of each chunk that carried content
        self.content_chunks = 0
        self.usage: dict[str, Any] | None = None
        self.done = False
        self.error: str | None = None

    def feed(self, line: bytes, now: float) -> None:
        if not line.startswith(b"data:"):
            return  # blank separators, comments, event names
        data = line[5:].strip()
        if data == b"[DONE]":
            self.done = True
            return
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            self.error = "malformed stream chunk"
            return
        if not isinstance(chunk, dict):
            return
        if "error" in chunk:
            # vLLM reports a failure inside an already started stream this way.
            self.error = error_text(chunk, "error in stream")
            return
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        if chunk_content(chunk):
            self.content_chunks += 1
            self.token_times.append(now)


def chunk_content(chunk: dict[str, Any]) -> str:
    """The text a chunk adds: chat `delta.content` or completions `text`."""
    choices = chunk.get("choices")
    if not choices or not isinstance(choices, list) or not isinstance(choices[0], dict):
        return ""
    choice = choices[0]
    delta = choice.get("delta")
    if isinstance(delta, dict):
        content = delta.get("content")
    else:
        content = choice.get("text")
    return content if isinstance(content, str) else ""


def read_answer(raw: bytes) -> tuple[Any, bool, str | None]:
    """(usage, whether it has content, error) of a non-streamed answer."""
    try:
        answer = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None, False, "malformed answer"
    if not isinstance(answer, dict):
        return None, False, "malformed answer"
    choices = answer.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else None
    content = None
    if isinstance(choice, dict):
        message = choice.get("message")
        content = message.get("content") if isinstance(message, dict) else choice.get("text")
    return answer.get("usage"), bool(content), None


def usage_counts(usage: Any) -> tuple[int, int, int | None]:
    """(prompt tokens, cached prompt tokens, completion tokens or None) from a usage block."""
    if not isinstance(usage, dict):
        return 0, 0, None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    completion = usage.get("completion_tokens")
    return (
        _int(usage.get("prompt_tokens")) or 0,
        _int(cached) or 0,
        _int(completion),
    )


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def error_text(body: Any, fallback: str) -> str:
    """`error.message` of an OpenAI error object, else whatever message there is, shortened."""
    message: Any = None
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict):
            message = error.get("message")
        elif isinstance(error, str):
            message = error
        if message is None:
            message = body.get("message") or body.get("detail")
    if not isinstance(message, str) or not message.strip():
        return fallback
    return _shorten(message.strip())


def error_from_body(raw: bytes, status: int) -> str:
    try:
        return error_text(orjson.loads(raw), f"HTTP {status}")
    except orjson.JSONDecodeError:
        text = raw.decode("utf-8", "replace").strip()
        return _shorten(text) if text else f"HTTP {status}"


def _shorten(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def client_error_text(exc: BaseException, timeout_s: float) -> str:
    """Short, stable texts, so that `error_kinds` groups alike failures together."""
    if isinstance(exc, TimeoutError):
        return f"timeout after {timeout_s:g} s"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"connect error ({type(exc.os_error).__name__})"
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
        return "connection lost"
    if isinstance(exc, aiohttp.ClientOSError | OSError):
        return f"connection error ({type(exc).__name__})"
    if isinstance(exc, ValueError):  # aiohttp's limit on one line of a stream
        return f"bad stream ({exc})"
    return type(exc).__name__
