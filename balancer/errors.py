"""Errors in the OpenAI format, so every client SDK shows the message instead of a parse error."""

from __future__ import annotations

import orjson
from aiohttp import web


def error_body(message: str, type_: str, code: str | None, param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})


def error_response(
    status: int,
    message: str,
    *,
    code: str | None,
    type_: str = "invalid_request_error",
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    return web.Response(
        status=status,
        body=error_body(message, type_, code, param),
        content_type="application/json",
        headers=headers,
    )


class ClientError(Exception):
    """A request the balancer refuses; carries the OpenAI-format answer it gets."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.type_ = type_
        self.param = param
        self.retry_after = retry_after

    def response(self, extra_headers: dict[str, str] | None = None) -> web.Response:
        headers = dict(extra_headers or {})
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        return error_response(
            self.status,
            self.message,
            code=self.code,
            type_=self.type_,
            param=self.param,
            headers=headers,
        )
