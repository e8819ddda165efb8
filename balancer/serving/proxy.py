"""Forward one request to the replicas of a ranking, in order, and relay the answer untouched.

Failover happens only before the client has seen a byte: a connect error, no response
headers within `first_byte_s`, or a 502/503 answer moves the request to the next replica in
the ranking, never the same one twice. Once the response has started, bytes are relayed as
they arrive and nothing is retried.

What counts against a replica (balancer/routing/breaker.py) is what the replica did: no connection,
no answer in time, an invalid or cut answer, 502/503/504, and 500s by success rate. A client
that stops reading ends its own answer (`timeouts.client_write_s`) and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import orjson

from balancer.config import Settings
from balancer.errors import ClientError
from balancer.protocol import GENERATE_ROUTE, REPLICA_HEADER
from balancer.routing.core import Journey, RoutingCore
from balancer.routing.fleet import Replica
from balancer.serving.answer_text import AnswerText
from balancer.serving.metrics import Metrics
from balancer.serving.tracing import TRACE_HEADERS
from balancer.serving.usage import (
    META_MARK,
    PROMPT_MARK,
    USAGE_MARK,
    TokenCounts,
    counts_from_sse,
    counts_of,
    has_usage,
    learnable,
    parse_json,
    usage_from_sse,
)
from balancer.wire.client import InvalidResponse, UpstreamError, UpstreamPool, UpstreamResponse
from balancer.wire.relay import StreamRelay
from balancer.wire.server import ClientStalled, Headers, Request, ResponseStream

log = logging.getLogger("kvlb.proxy")

# RFC 9110 §7.6.1: meaningful only for one connection, never forwarded; Content-Length is
# recomputed by the side that writes the message.
RESPONSE_DROP = frozenset(
    {
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
        "te", "trailer", "transfer-encoding", "upgrade", "content-length",
    }
)
# Answers that move a request to the next replica: the replica is down, overloaded or
# rate-limiting; nothing was generated, so nothing is lost by asking another.
RETRY_STATUSES = frozenset({429, 502, 503})
# Relayed answers that are the replica's fault whoever asked: a gateway timeout. Other 5xx
# (500 above all) may be the request's doing and are judged by success rate.
FAULT_STATUSES = frozenset({504})
MAX_RETRY_AFTER_S = 3600.0
# Bodies this small with a known length are answered in one write; anything else is relayed
# chunk by chunk so memory stays flat and streams stay live.
BUFFER_LIMIT_BYTES = 1 << 20
# An engine's "no such model" answer is a line of JSON; a bigger 404 is not one.
GONE_BODY_LIMIT = 16 * 1024
# An attempt answered 404 for an adapter the replica no longer holds: no fault of the replica's.
ADAPTER_GONE = "adapter_gone"
# The error code when every replica tried had lost the request's adapter.
ADAPTER_NOT_LOADED = "adapter_not_loaded"


@dataclass(slots=True)
class Outcome:
    """What happened to one request, for metrics and logs."""

    replica: str = "none"
    status: int = 0
    attempts: list[str] = field(default_factory=list)
    # Set once response headers went to the client: from then on nothing can be retried.
    stream: ResponseStream | None = None
    sse: bool = False
    model: str = ""  # the request's `model`, "" when it names none
    error: str = ""  # the code of the balancer's own error answer, if it gave one
    answered: bool = False  # a replica's answer is being (or was) relayed
    # Loop time when the answer's first byte went to the client (a whole non-streamed answer).
    first_byte_at: float | None = None
    # What the replica reported, when it did (read only while the access log is on).
    tokens: TokenCounts | None = None
    # Its spans, with tracing on (serving/tracing.py's RequestTrace); None otherwise.
    trace: Any = None


async def end_broken_response(request: Request, outcome: Outcome, reason: str) -> None:
    """End a response that started but cannot finish, so that it never looks complete.

    An SSE client gets a final `data: {"error": ...}` event and a clean end of stream; any
    other body, and any client that has stopped reading (it would never take the event), is
    cut by closing the connection before its end.
    """
    stream = outcome.stream
    assert stream is not None
    if outcome.sse and not request.client_stalled:
        event = {"error": {"message": reason, "type": "upstream_error", "code": "stream_broken"}}
        with contextlib.suppress(ConnectionError):
            await stream.write(b"data: " + orjson.dumps(event) + b"\n\n")
            await stream.end()
    else:
        request.abort()


def upstream_headers(request: Request, request_id: str, id_header: str) -> Headers:
    """The client's end-to-end headers, less any the Connection header names, plus the id."""
    connection = request.header("connection")
    tokens = {t.strip().lower() for t in connection.split(",")} - {"keep-alive", "close"} if connection else None
    if tokens:
        out = [(n, v) for n, v in request.end_to_end_headers if n.lower() not in tokens]
    else:
        out = list(request.end_to_end_headers)
    if request.header(id_header) is not None:
        out = [(n, v) for n, v in out if n.lower() != id_header]
    out.append((id_header, request_id))
    return out


def adapter_not_loaded(adapter: str | None, gone: list[str]) -> ClientError:
    """Every replica tried had lost the adapter since kvlb read its listing: they are no
    longer routed it, and the client may come back at once."""
    return ClientError(
        503, f"adapter {adapter!r} is no longer loaded on {', '.join(gone)}; "
        "kvlb routes it elsewhere from now on", ADAPTER_NOT_LOADED,
        type_="service_unavailable", retry_after=1)


def failure_kind(exc: OSError | TimeoutError) -> str:
    """How an attempt that got no response failed, for metrics and the breaker."""
    if isinstance(exc, TimeoutError):
        return "timeout"
    return "invalid_response" if isinstance(exc, InvalidResponse) else "connect_error"


def _retry_after_seconds(value: str | None) -> float | None:
    """Retry-After as seconds (RFC 9110 §10.2.3 delay-seconds; an HTTP date is ignored)."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return min(seconds, MAX_RETRY_AFTER_S) if seconds >= 0 else None


class Proxy:
    """Sends a request to the replicas its journey names, in turn, and relays the answer.
    Every decision (which replica next, what counts against it, the load and the index) is
    the routing core's; this class does the I/O and counts what it saw."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        pool: UpstreamPool,
        core: RoutingCore,
        replica_authorization: str | None = None,
    ) -> None:
        self.replica_authorization = replica_authorization
        self.settings = settings
        self.metrics = metrics
        self.pool = pool
        self.core = core
        self.configure(settings)

    def configure(self, settings: Settings) -> None:
        self.settings = settings
        self.expose_replica = settings.headers.expose_replica
        self.id_header = settings.headers.request_id
        # Token counts are for the access log only: without it, no answer is parsed for them.
        self.read_usage = settings.logging.access_log

    async def forward(
        self,
        request: Request,
        journey: Journey,
        request_id: str,
        outcome: Outcome,
        extra_headers: Headers | None = None,
    ) -> None:
        """`extra_headers` go on the answer."""
        first_byte_s = self.settings.timeouts.first_byte_s
        core = self.core
        headers = self.headers_for_replicas(request, request_id)
        failures: list[str] = []
        loop = asyncio.get_running_loop()
        retry_after: float | None = None
        outcome.attempts = journey.attempts
        gone: list[str] = []
        trace = outcome.trace
        if trace is not None:
            # Each attempt carries its own span's context in place of the client's.
            headers = [(n, v) for n, v in headers if n.lower() not in TRACE_HEADERS]
        while (replica := core.next_attempt(journey, loop.time())) is not None:
            outcome.replica = replica.name
            resp: UpstreamResponse | None = None
            answered = False
            attempt = "error"  # how the attempt ended, for its span
            try:
                sent = headers if trace is None else headers + trace.attempt(replica.name)
                try:
                    resp = await self.pool.request(
                        replica.url, request.method, request.target, sent, request.body, first_byte_s
                    )
                except (TimeoutError, OSError) as exc:
                    kind = attempt = failure_kind(exc)
                    failures.append(f"{replica.name}: {kind} ({exc.__class__.__name__})")
                    self._failed(journey, kind, loop.time())
                    continue
                attempt = f"http_{resp.status}"
                if resp.status == 404 and await self.adapter_gone(journey, replica, resp):
                    # Unloaded since kvlb last read its listing (by a peer instance making
                    # room, an operator): the replicas that still hold it take the request.
                    gone.append(replica.name)
                    failures.append(f"{replica.name}: HTTP 404 (adapter {journey.features.adapter!r} gone)")
                    self.metrics.count_attempt(replica.name, ADAPTER_GONE)
                    continue
                if resp.status in RETRY_STATUSES:
                    failures.append(f"{replica.name}: HTTP {resp.status}")
                    wait = _retry_after_seconds(resp.header("Retry-After"))
                    if wait is not None:
                        # The replica said when to come back: route elsewhere until then.
                        core.held_off(journey, loop.time(), wait)
                        retry_after = wait if retry_after is None else min(retry_after, wait)
                        self.metrics.count_attempt(replica.name, f"http_{resp.status}")
                    elif resp.status == 429:
                        self.metrics.count_attempt(replica.name, "http_429")
                    else:
                        self._failed(journey, f"http_{resp.status}", loop.time())
                    continue
                outcome.status = resp.status
                answered = outcome.answered = True
                # Judged once the answer is through: a cut body is the replica's fault too.
                fault = await self._relay(request, resp, replica, journey, request_id, outcome, extra_headers)
                attempt = self.judge(journey, replica, resp.status, fault, request.client)
                return
            finally:
                if resp is not None:
                    resp.close()
                core.end_attempt(journey, answered=answered, now=loop.time())
                if trace is not None:
                    trace.attempt_ended(attempt)
        if gone and len(gone) == len(failures):
            raise adapter_not_loaded(journey.features.adapter, gone)
        raise ClientError(
            502,
            f"all {len(failures)} attempt(s) failed: " + "; ".join(failures),
            "upstream_failed",
            type_="upstream_error",
            retry_after=None if retry_after is None else max(1, round(retry_after)),
        )

    def headers_for_replicas(self, request: Request, request_id: str) -> Headers:
        """What every attempt sends: the client's end-to-end headers and the request id,
        with the replicas' own key in place of the client's, which then never leaves kvlb."""
        headers = upstream_headers(request, request_id, self.id_header)
        if self.replica_authorization is not None:
            headers = [(n, v) for n, v in headers if n.lower() != "authorization"]
            headers.append(("Authorization", self.replica_authorization))
        return headers

    async def adapter_gone(self, journey: Journey, replica: Replica, resp: UpstreamResponse) -> bool:
        """The replica answered 404, naming the adapter, to a request for an adapter that kvlb
        knows it serves only from its listing: it no longer holds it, and is not routed it
        again until a listing names it (config's adapters are taken at their word). A 404
        that does not name it (a route this replica lacks) is relayed as it is."""
        adapter = journey.features.adapter
        if adapter is None or adapter in replica.settings.adapters or not replica.serves_adapter(adapter):
            return False
        try:
            async with asyncio.timeout(self.settings.timeouts.stream_idle_s):
                body = await resp.peek(GONE_BODY_LIMIT)
        except TimeoutError:
            return False
        # vLLM's answer: "The model `NAME` does not exist."
        if body is None or orjson.dumps(adapter)[1:-1] not in body:
            return False
        replica.adapter_unloaded(adapter)
        self.core.fleet.refresh_adapters()
        return True

    def judge(self, journey: Journey, replica: Replica, status: int, fault: str | None,
              client: str | None) -> str:
        """An answer relayed to the client, counted against its replica by what the replica
        did: a cut answer or a gateway timeout fails it, any other answer counts towards its
        success rate (a 5xx against it, a 4xx, the request's own fault, for it). Returns
        how the attempt ended."""
        now = asyncio.get_running_loop().time()
        if fault is not None:
            self._failed(journey, fault, now)
            return fault
        if status in FAULT_STATUSES:
            self._failed(journey, f"http_{status}", now)
            return f"http_{status}"
        self.metrics.count_attempt(replica.name, "ok")
        if self.core.answered(journey, now, status < 500, client):
            self._ejected(replica, f"success rate (HTTP {status})")
        return f"http_{status}"

    def _failed(self, journey: Journey, kind: str, now: float) -> None:
        replica = journey.replica
        assert replica is not None
        self.metrics.count_attempt(replica.name, kind)
        if self.core.failed(journey, now):
            self._ejected(replica, kind)

    def _ejected(self, replica: Replica, why: str) -> None:
        log.warning("replica %s ejected after %s (ejection %d in a row)",
                    replica.name, why, replica.breaker.ejections)

    def _response_headers(
        self, resp: UpstreamResponse, replica: Replica, request_id: str, extra: Headers | None
    ) -> Headers:
        id_header = self.id_header
        out = [
            (name, value) for name, value in resp.headers
            if (lower := name.lower()) not in RESPONSE_DROP and lower != id_header
        ]
        out.append((id_header, request_id))
        if self.expose_replica:
            out.append((REPLICA_HEADER, replica.name))
        if extra:
            out += extra
        return out

    def _first_byte(self, journey: Journey, outcome: Outcome) -> None:
        if outcome.trace is not None:
            outcome.trace.first_byte()
        error = self.core.first_byte(journey, asyncio.get_running_loop().time())
        if error is not None:
            self.metrics.observe_ttft_error(error)

    def _learn(self, journey: Journey, replica: Replica, usage: tuple[int, int | None] | None) -> None:
        if usage is None:
            return
        lesson = self.core.learn(journey, *usage)
        if lesson is not None:
            routed = journey.routed
            assert routed is not None
            self.metrics.observe_lesson(
                replica.name, lesson.predicted, lesson.actual, lesson.corrected, routed.prompt_tokens
            )

    async def _relay(
        self,
        request: Request,
        resp: UpstreamResponse,
        replica: Replica,
        journey: Journey,
        request_id: str,
        outcome: Outcome,
        extra_headers: Headers | None,
    ) -> str | None:
        """Relay the answer; returns the replica's fault that broke it, if one did."""
        idle_s = self.settings.timeouts.stream_idle_s
        headers = self._response_headers(resp, replica, request_id, extra_headers)
        routed = journey.routed
        length = resp.content_length
        is_sse = (resp.header("Content-Type") or "").startswith("text/event-stream")
        if length is not None and length <= BUFFER_LIMIT_BYTES and not is_sse:
            if resp.complete:
                data = await resp.read(BUFFER_LIMIT_BYTES)  # nothing to wait for, so no timer
            else:
                try:
                    async with asyncio.timeout(idle_s):
                        data = await resp.read(BUFFER_LIMIT_BYTES)
                except (UpstreamError, TimeoutError) as exc:
                    raise self._broken_body(journey, replica, exc, idle_s) from None
            request.respond(resp.status, headers, data)
            outcome.first_byte_at = asyncio.get_running_loop().time()
            read_usage = self.read_usage and has_usage(data)
            answer = self._answer_text(journey, resp)
            payload = (parse_json(data) if read_usage or answer is not None
                       or (routed is not None and PROMPT_MARK in data) else None)
            counts = counts_of(payload)
            if read_usage:
                outcome.tokens = counts
            self._first_byte(journey, outcome)
            if routed is not None:
                self._learn(journey, replica, learnable(counts))
                if counts is not None and counts.output is not None:
                    self.core.learned_output(journey, counts.output)
            if answer is not None:
                answer.body(payload=payload)
                self.core.answered_text(journey, answer.text)
            return None

        stream = await request.start_stream(resp.status, headers, length)
        outcome.stream, outcome.sse = stream, is_sse
        # The last chunk with token counts, and the one after it (an event may straddle them):
        # parsed once, when the stream ends, for the access log and the answer's length. A
        # prompt count lives only in such a chunk, so other chunks cost one scan and no call:
        # SGLang's /generate carries its counts in `meta_info`, the OpenAI routes in `usage`.
        usage: list[bytes] = []
        on_chunk = None
        teaches = journey.reads_answer
        generate = journey.features.route == GENERATE_ROUTE
        answer = self._answer_text(journey, resp)
        # /generate repeats its text so far in every event: its last one is read at the end.
        feed = None if answer is None or generate else answer.feed
        if self.read_usage or teaches:
            mark = META_MARK if generate else USAGE_MARK

            def on_chunk(chunk: bytes) -> None:
                if feed is not None:
                    feed(chunk)
                if mark in chunk:
                    usage[:] = [chunk]
                    if routed is not None and not routed.learned:
                        self._learn(journey, replica, usage_from_sse(chunk))
                elif len(usage) == 1:
                    usage.append(chunk)

        relay = StreamRelay(stream, resp, asyncio.get_running_loop(), idle_s, on_chunk,
                            lambda: self._first_byte(journey, outcome))
        try:
            await relay.run()
        except ClientStalled:
            log.info("request %s: the client stopped reading; its stream is cut", request_id)
            self.metrics.count_client_stall(request.path)
            outcome.error = "client_stalled"
            request.abort()
            return None
        except (UpstreamError, TimeoutError) as exc:
            log.warning("request %s: stream from %s broke: %r", request_id, replica.name, exc)
            await end_broken_response(
                request, outcome, f"the stream from replica {replica.name} broke: {exc.__class__.__name__}"
            )
            return "broken_stream"
        except ConnectionError:
            request.abort()  # the client went away while being written to
            return None
        finally:
            outcome.first_byte_at = relay.first_at
            counts = counts_from_sse(b"".join(usage)) if usage else None
            if self.read_usage:
                outcome.tokens = counts
        if teaches and counts is not None and counts.output is not None:
            error = self.core.learned_output(journey, counts.output, asyncio.get_running_loop().time())
            if error is not None:
                self.metrics.observe_itl_error(error)
        await stream.end()
        if answer is not None:  # after the client has its whole answer
            if generate and usage:
                answer.from_last_event(b"".join(usage))
            self.core.answered_text(journey, answer.text)
        return None

    def _answer_text(self, journey: Journey, resp: UpstreamResponse) -> AnswerText | None:
        """A collector of the answer's text where the index records it: a success only,
        since an error body is not an answer the next turn would send back."""
        if resp.status != 200:
            return None
        chars = self.core.answer_chars(journey)
        return AnswerText(journey.features.route, chars) if chars else None

    def _broken_body(self, journey: Journey, replica: Replica, exc: Exception, idle_s: float) -> ClientError:
        """A whole answer the replica cut or stalled before the client saw any of it."""
        now = asyncio.get_running_loop().time()
        if isinstance(exc, TimeoutError):
            self._failed(journey, "timeout", now)
            return ClientError(
                504, f"replica {replica.name} stopped sending its answer for timeouts.stream_idle_s "
                     f"({idle_s} s)", "timeout", type_="upstream_error")
        self._failed(journey, "broken_body", now)
        return ClientError(502, f"replica {replica.name} cut its answer short: {exc}",
                           "upstream_failed", type_="upstream_error")
