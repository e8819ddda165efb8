"""Forward one request to the replicas of a ranking, in order, and relay the answer untouched.

Failover happens only before the client has seen a byte: a connect error, no response
headers within `first_byte_s`, or a 502/503 answer moves the request to the next replica in
the ranking, never the same one twice. Once the response has started, bytes are relayed as
they arrive and nothing is retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import orjson
from aiohttp import web
from multidict import CIMultiDictProxy

from balancer.config import Settings
from balancer.errors import ClientError
from balancer.fleet import Replica
from balancer.metrics import Metrics
from balancer.upstream import UpstreamError, UpstreamPool, UpstreamResponse
from policies.base import Choice

log = logging.getLogger("kvlb.proxy")

# RFC 9110 §7.6.1: meaningful only for one connection, never forwarded.
HOP_BY_HOP = frozenset(
    {
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
        "te", "trailer", "transfer-encoding", "upgrade",
    }
)
# Recomputed by the side that writes the message.
REQUEST_DROP = HOP_BY_HOP | {"host", "content-length"}
RESPONSE_DROP = HOP_BY_HOP | {"content-length", "date", "server"}
RETRY_STATUSES = frozenset({502, 503})
# Bodies this small with a known length are answered in one write; anything else is relayed
# chunk by chunk so memory stays flat and streams stay live.
BUFFER_LIMIT_BYTES = 1 << 20
REPLICA_HEADER = "x-kvlb-replica"


@dataclass(slots=True)
class Outcome:
    """What happened to one request, for metrics and logs."""

    replica: str = "none"
    status: int = 0
    attempts: list[str] = field(default_factory=list)
    # Set once response headers went to the client: from then on nothing can be retried.
    response: web.StreamResponse | None = None
    sse: bool = False


async def end_broken_response(request: web.Request, outcome: Outcome, reason: str) -> None:
    """End a response that started but cannot finish, so that it never looks complete.

    An SSE client gets a final `data: {"error": ...}` event; any other body is cut by
    closing the connection without the closing chunk.
    """
    out = outcome.response
    assert out is not None
    if outcome.sse:
        event = {"error": {"message": reason, "type": "upstream_error", "code": "stream_broken"}}
        with contextlib.suppress(ConnectionError):
            await out.write(b"data: " + orjson.dumps(event) + b"\n\n")
            await out.write_eof()
    elif request.transport is not None:
        request.transport.abort()


def upstream_headers(headers: CIMultiDictProxy[str], request_id: str, id_header: str) -> list[tuple[str, str]]:
    connection = headers.get("connection")
    connection_tokens = (
        {token.strip().lower() for token in connection.split(",")} if connection else ()
    )
    out = [
        (name, value)
        for name, value in headers.items()
        if (lower := name.lower()) not in REQUEST_DROP
        and lower not in connection_tokens
        and lower != id_header
    ]
    out.append((id_header, request_id))
    return out


class Proxy:
    def __init__(self, settings: Settings, metrics: Metrics, pool: UpstreamPool) -> None:
        self.settings = settings
        self.metrics = metrics
        self.pool = pool
        self.max_attempts = settings.retries.max_attempts
        self.expose_replica = settings.headers.expose_replica
        self.id_header = settings.headers.request_id

    async def forward(
        self,
        request: web.Request,
        body: bytes,
        ranking: Sequence[Choice],
        request_id: str,
        outcome: Outcome,
    ) -> web.StreamResponse:
        timeouts = self.settings.timeouts
        loop = asyncio.get_running_loop()
        headers = upstream_headers(request.headers, request_id, self.id_header)
        path_qs = request.rel_url.raw_path_qs
        failures: list[str] = []
        for choice in ranking[: self.max_attempts]:
            replica: Replica = choice.replica  # type: ignore[assignment]
            outcome.replica = replica.name
            outcome.attempts.append(replica.name)
            replica.in_flight += 1
            resp: UpstreamResponse | None = None
            try:
                try:
                    async with asyncio.timeout(timeouts.first_byte_s):
                        resp = await self.pool.request(
                            replica.url, request.method, path_qs, headers, body
                        )
                except (TimeoutError, OSError) as exc:
                    kind = "timeout" if isinstance(exc, TimeoutError) else "connect_error"
                    failures.append(f"{replica.name}: {kind} ({exc.__class__.__name__})")
                    self._count_attempt(replica.name, kind)
                    continue
                if resp.status in RETRY_STATUSES:
                    failures.append(f"{replica.name}: HTTP {resp.status}")
                    self._count_attempt(replica.name, f"http_{resp.status}")
                    resp.close()
                    resp = None
                    continue
                self._count_attempt(replica.name, "ok")
                outcome.status = resp.status
                return await self._relay(request, resp, replica, request_id, outcome, loop)
            finally:
                if resp is not None:
                    resp.close()
                replica.in_flight -= 1
        outcome.replica = "none"
        raise ClientError(
            502,
            f"all {len(failures)} attempt(s) failed: " + "; ".join(failures),
            "upstream_failed",
            type_="upstream_error",
        )

    def _count_attempt(self, replica: str, outcome: str) -> None:
        self.metrics.count_attempt(replica, outcome)

    def _response_headers(self, resp: UpstreamResponse, replica: Replica, request_id: str) -> list[tuple[str, str]]:
        id_header = self.id_header
        out = [
            (name, value) for name, value in resp.headers
            if (lower := name.lower()) not in RESPONSE_DROP and lower != id_header
        ]
        out.append((id_header, request_id))
        if self.expose_replica:
            out.append((REPLICA_HEADER, replica.name))
        return out

    async def _relay(
        self,
        request: web.Request,
        resp: UpstreamResponse,
        replica: Replica,
        request_id: str,
        outcome: Outcome,
        loop: asyncio.AbstractEventLoop,
    ) -> web.StreamResponse:
        idle_s = self.settings.timeouts.stream_idle_s
        headers = self._response_headers(resp, replica, request_id)
        length = resp.content_length
        content_type = resp.header("Content-Type") or ""
        is_sse = content_type.startswith("text/event-stream")
        if length is not None and length <= BUFFER_LIMIT_BYTES and not is_sse:
            if resp.complete:
                data = await resp.read(BUFFER_LIMIT_BYTES)  # no wait, so no timer to arm
            else:
                async with asyncio.timeout(idle_s):
                    data = await resp.read(BUFFER_LIMIT_BYTES)
            return web.Response(status=resp.status, body=data, headers=headers)

        out = web.StreamResponse(status=resp.status, headers=headers)
        if length is not None:
            out.content_length = length
        await out.prepare(request)
        outcome.response, outcome.sse = out, is_sse
        try:
            async with asyncio.timeout(idle_s) as idle:
                async for chunk in resp.iter_chunks():
                    await out.write(chunk)
                    idle.reschedule(loop.time() + idle_s)
        except (UpstreamError, TimeoutError) as exc:
            # The answer has started, so no retry: make the break visible instead of ending
            # the stream cleanly, which a client would take for a complete answer.
            log.warning("request %s: stream from %s broke: %r", request_id, replica.name, exc)
            self.metrics.count_attempt(replica.name, "broken_stream")
            reason = f"the stream from replica {replica.name} broke: {exc.__class__.__name__}"
            await end_broken_response(request, outcome, reason)
            return out
        await out.write_eof()
        return out

