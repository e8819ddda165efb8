"""Request ids: the client's own when it is safe to repeat, else one of kvlb's."""

from __future__ import annotations

import os
import re
from collections.abc import Callable

from balancer.errors import JSON_HEADERS, ClientError
from balancer.wire.server import Headers, Request

# A client's request id travels to replicas, answers and log lines as given, so it must be
# text that cannot forge a log field or a header: anything else is replaced by kvlb's own.
SAFE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")


def safe_request_id(value: str | None) -> str | None:
    return value if value is not None and SAFE_REQUEST_ID.fullmatch(value) else None


class RequestIds:
    def __init__(self) -> None:
        # A random per-process prefix and a counter: unique without a syscall per request.
        self._prefix = os.urandom(6).hex()
        self._seq = 0

    def new(self) -> str:
        self._seq += 1
        return f"{self._prefix}{self._seq:012x}"

    def of(self, request: Request, id_header: str) -> str:
        return safe_request_id(request.header(id_header)) or self.new()


def make_error_answer(id_header: str) -> Callable[[int, str, str, Request | None], tuple[Headers, bytes]]:
    def error_answer(status: int, message: str, code: str, request: Request | None) -> tuple[Headers, bytes]:
        """Answers for requests refused while being read (bad framing, limits), OpenAI-shaped."""
        headers = list(JSON_HEADERS)
        request_id = safe_request_id(request.header(id_header)) if request is not None else None
        headers.append((id_header, request_id or os.urandom(12).hex()))
        return headers, ClientError(status, message, code).body()

    return error_answer
