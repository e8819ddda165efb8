"""Errors in the OpenAI format, so every client SDK shows the message instead of a parse error."""

from __future__ import annotations

import orjson

JSON_HEADERS = [("Content-Type", "application/json")]


def error_body(message: str, type_: str, code: str | None, param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})


def error_type_for(status: int) -> str:
    if status >= 500:
        return "server_error" if status == 500 else "service_unavailable" if status == 503 else "upstream_error"
    return "invalid_request_error"


class ClientError(Exception):
    """A request the balancer refuses; carries the OpenAI-format answer it gets."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        *,
        type_: str | None = None,
        param: str | None = None,
        retry_after: int | None = None,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.type_ = type_ or error_type_for(status)
        self.param = param
        self.retry_after = retry_after
        self.extra_headers = headers

    def headers(self) -> list[tuple[str, str]]:
        headers = list(JSON_HEADERS)
        if self.retry_after is not None:
            headers.append(("Retry-After", str(self.retry_after)))
        headers.extend(self.extra_headers)
        return headers

    def body(self) -> bytes:
        return error_body(self.message, self.type_, self.code, self.param)
