"""The client-facing HTTP/1.1 server: one asyncio protocol per connection, no framework.

A general web framework spends several times the CPU of everything else the proxy does per
request (request objects, routing tables, middleware and signal plumbing). This server does
only what a proxy needs: parse the request line, headers and body framing, enforce limits
and deadlines, hand the complete request to one handler, and write what it answers, either
in one piece or streamed with backpressure. A client that goes away cancels its handler, and
with it the request to the replica.

Framing follows RFC 9112: Content-Length or chunked request bodies (both at once is refused,
as it is the classic request-smuggling vector), `Expect: 100-continue`, keep-alive by default
on HTTP/1.1, pipelined requests answered in order.

What one client can hold is bounded: open connections (`max_connections`), request bodies
buffered by all connections together (`max_buffered_bytes`, counted from a request's head to
the end of its answer), and the time a write may wait for a client that does not read
(`write_timeout_s`). A request can be refused on its head alone (`admit`: keys, rate limits),
before any of its body is read or `100 Continue` is sent. Nothing a connection buffered
outlives it: a connection that closes drops its request and body at once, not at the next
cyclic garbage collection.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from email.utils import formatdate
from http import HTTPStatus

from balancer.wire.chunked import ChunkedDecoder, ChunkedError, ChunkedTooLarge
from balancer.wire.memory import LARGE_BODY_BYTES, large_body_freed

log = logging.getLogger("kvlb.http")

Headers = list[tuple[str, str]]
# Headers about this connection or this message's framing, never forwarded by a proxy
# (RFC 9110 §7.6.1 hop-by-hop, plus what the next hop recomputes).
CONNECTION_HEADERS = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "transfer-encoding", "upgrade", "host", "content-length", "expect",
})
_REASONS = {s.value: s.phrase for s in HTTPStatus}
# RFC 9110 tokens for methods and header names; header values: visible ASCII, tab, space and
# obs-text, so no CR, LF or NUL can smuggle a second header or request through.
_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_REQUEST_LINE = re.compile(rb"(" + _TOKEN + rb") (/[\x21-\x7e\x80-\xff]*) (HTTP/1\.[01])")
_HEADER_BLOCK = re.compile(rb"(?:" + _TOKEN + rb":[\t\x20-\x7e\x80-\xff]*\r\n)*")


class HttpError(Exception):
    """A request that cannot be read; answered with `status` and the connection closed."""

    def __init__(self, status: int, message: str, code: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.retry_after = retry_after


class ClientStalled(ConnectionError):
    """The client has not read what was written to it within `write_timeout_s`."""


class Request:
    """One parsed request; `headers` keeps names as sent, `header()` looks up case-blind."""

    __slots__ = ("method", "target", "path", "version", "headers", "end_to_end_headers", "_lookup",
                 "body", "remote", "client", "_conn")

    def __init__(self, method: str, target: str, version: str, headers: Headers,
                 lookup: dict[str, str], conn: _Connection) -> None:
        self.method = method
        self.target = target  # path and query as sent
        self.path = target.split("?", 1)[0]
        self.version = version
        self.headers = headers
        # The headers a proxy forwards: `headers` without CONNECTION_HEADERS.
        self.end_to_end_headers: Headers = headers
        self._lookup = lookup
        self.body = b""
        self.remote = conn.peer
        # Who sent it, as the `admit` hook established (an API key's identity, else the peer
        # address): one client's behaviour is judged apart from another's.
        self.client = conn.peer
        self._conn = conn

    def header(self, name: str) -> str | None:
        return self._lookup.get(name)  # names are stored lower-case

    # answering --------------------------------------------------------------------------------

    def respond(self, status: int, headers: Iterable[tuple[str, str]], body: bytes) -> None:
        """Answer in one piece."""
        self._conn.write_response(self, status, headers, body)

    async def start_stream(self, status: int, headers: Iterable[tuple[str, str]],
                           content_length: int | None = None) -> ResponseStream:
        """Begin an answer whose body follows in pieces (chunked unless the length is known)."""
        return self._conn.start_stream(self, status, headers, content_length)

    @property
    def answered(self) -> bool:
        return self._conn.response_started

    @property
    def client_stalled(self) -> bool:
        """The client has stopped reading: our writes are piling up unread."""
        return self._conn.write_paused

    def abort(self) -> None:
        """Cut the connection: the client sees an incomplete answer, never a finished one."""
        self._conn.abort()


class ResponseStream:
    __slots__ = ("_conn", "_chunked", "_ended")

    def __init__(self, conn: _Connection, chunked: bool) -> None:
        self._conn = conn
        self._chunked = chunked
        self._ended = False

    def send(self, data: bytes) -> bool:
        """Queue `data` for the client without waiting; True when the client is not keeping
        up (`watch_flow` says when it has caught up)."""
        conn = self._conn
        if conn.closed:
            raise ConnectionResetError("client went away")
        if data:
            if self._chunked:
                conn.transport.write(b"%x\r\n%b\r\n" % (len(data), data))
            else:
                conn.transport.write(data)
        return conn.write_paused

    def watch_flow(self, listener: Callable[[bool], None] | None) -> None:
        """Call `listener(True)` when the client stops keeping up, `listener(False)` when it
        has caught up again (None: stop): backpressure for writers that never await."""
        self._conn.flow_listener = listener

    @property
    def write_timeout_s(self) -> float:
        return self._conn.limits.write_timeout_s

    async def write(self, data: bytes) -> None:
        if self.send(data):
            await self._conn.drain()

    async def end(self) -> None:
        self.finish()

    def finish(self) -> None:
        """End the answer now, without waiting: for writers called back by the connection."""
        if self._ended:
            return
        self._ended = True
        if self._chunked and not self._conn.closed:
            self._conn.transport.write(b"0\r\n\r\n")


Handler = Callable[[Request], Awaitable[None]]
# (status, message, code, the request's headers when they were read) -> (headers, body)
ErrorBody = Callable[[int, str, str, "Request | None"], tuple[Headers, bytes]]


# A refusal decided on a request's head: (status, headers, body).
Answer = tuple[int, Headers, bytes]
Admit = Callable[[Request], "Answer | None"]


class ServerLimits:
    __slots__ = ("max_header_bytes", "max_body_bytes", "header_timeout_s", "body_timeout_s",
                 "keepalive_timeout_s", "max_headers", "max_connections", "max_buffered_bytes",
                 "write_timeout_s")

    def __init__(self, *, max_header_bytes: int = 16384, max_body_bytes: int = 32 << 20,
                 header_timeout_s: float = 30.0, body_timeout_s: float = 60.0,
                 keepalive_timeout_s: float = 75.0, max_headers: int = 128,
                 max_connections: int = 4096, max_buffered_bytes: int = 512 << 20,
                 write_timeout_s: float = 30.0) -> None:
        self.max_header_bytes = max_header_bytes
        self.max_body_bytes = max_body_bytes
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.keepalive_timeout_s = keepalive_timeout_s
        self.max_headers = max_headers
        self.max_connections = max_connections
        self.max_buffered_bytes = max_buffered_bytes
        self.write_timeout_s = write_timeout_s


class HttpServer:
    """Shared by every connection: the handler, the limits and the open connections."""

    def __init__(self, handler: Handler, error_body: ErrorBody, limits: ServerLimits,
                 admit: Admit | None = None, tcp_nodelay: bool = True,
                 refusals: Counter[str] | None = None) -> None:
        self.handler = handler
        self.tcp_nodelay = tcp_nodelay  # the event loop sets it on every TCP connection
        self.error_body = error_body
        self.limits = limits
        # Called with each request's head before its body is read; an answer refuses it.
        self.admit = admit
        self.connections: set[_Connection] = set()
        # Body bytes reserved by every connection together (see limits.max_buffered_bytes).
        self.buffered_bytes = 0
        # Requests refused while being read, by error code (a fixed set, never the client's
        # text), for /metrics; several servers may share one.
        self.refusals: Counter[str] = Counter() if refusals is None else refusals
        self._server: asyncio.Server | None = None
        # Shutting down: answers in progress finish, then their connections close.
        self.closing = False
        self._date = b""
        self._date_second = -1

    def date_header(self, now: float) -> bytes:
        second = int(now)
        if second != self._date_second:
            self._date_second = second
            self._date = formatdate(second, usegmt=True).encode()
        return self._date

    async def listen(self, host: str, port: int, backlog: int = 1024, reuse_port: bool = False) -> int:
        """`reuse_port`: several processes listen on the same port and the kernel spreads the
        connections over them (kvlb serve --workers)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self), host, port, backlog=backlog, reuse_port=reuse_port or None
        )
        return self._server.sockets[0].getsockname()[1]

    async def close(self, grace_s: float = 10.0) -> None:
        """Stop accepting; let requests in progress finish within `grace_s`; close the rest."""
        self.closing = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            if conn.handler_task is None:
                conn.abort()
        deadline = asyncio.get_running_loop().time() + grace_s
        while any(c.handler_task is not None for c in self.connections):
            if asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            conn.abort()
        if self._server is not None:
            await self._server.wait_closed()


class _Connection(asyncio.Protocol):
    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.limits = server.limits
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.peer = ""
        self.closed = False
        self.write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._buffer = bytearray()
        self._request: Request | None = None  # the request whose body is being read
        self._body_left = 0
        self._chunked = False
        self._decoder = ChunkedDecoder()
        self._body_parts: list[bytes] = []
        self._body_size = 0
        self._keep_alive = True
        self.handler_task: asyncio.Task[None] | None = None
        self.response_started = False
        self._reading_paused = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_kind = ""  # "idle", "head", "body" or "write": what the timer guards
        self._reserved = 0  # this connection's share of server.buffered_bytes
        self.flow_listener: Callable[[bool], None] | None = None

    # connection lifecycle ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if not self.server.tcp_nodelay:
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 0)
        peer = transport.get_extra_info("peername")
        self.peer = peer[0] if isinstance(peer, tuple) else ""
        server = self.server
        if len(server.connections) >= self.limits.max_connections:
            self._refuse(HttpError(503, f"kvlb has limits.max_connections "
                                        f"({self.limits.max_connections}) open; retry shortly",
                                   "too_many_connections", retry_after=1))
            return
        server.connections.add(self)
        self._arm(self.limits.keepalive_timeout_s, self._idle_expired, "idle")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        self._disarm()
        self._drop_input()
        if self.handler_task is not None and not self.handler_task.done():
            self.handler_task.cancel()
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_exception(ConnectionResetError("client went away"))

    def _drop_input(self) -> None:
        """Let go of everything read and not yet handed over. The request being read points
        back at this connection, so without this the pair (and its body) would wait for the
        cyclic collector, however long that takes."""
        self._request = None
        self._body_parts = []
        self._buffer = bytearray()
        self._decoder = ChunkedDecoder()
        if self.handler_task is None:
            self._release_body()

    def _reserve_body(self, size: int) -> None:
        server = self.server
        if server.buffered_bytes + size > self.limits.max_buffered_bytes:
            raise HttpError(503, "kvlb is buffering limits.max_buffered_bytes of request bodies; "
                                 "retry shortly", "buffer_budget_exceeded", retry_after=1)
        server.buffered_bytes += size
        self._reserved += size

    def _release_body(self) -> None:
        if self._reserved >= LARGE_BODY_BYTES:
            large_body_freed()
        self.server.buffered_bytes -= self._reserved
        self._reserved = 0

    def eof_received(self) -> bool:
        # TCP cannot tell a half-close from a client that went away until a write fails, and
        # an abandoned generation must stop at once to free its replica: close, which cancels
        # the request (as nginx answers 499).
        return False

    def pause_writing(self) -> None:
        self.write_paused = True
        if self.flow_listener is not None:
            self.flow_listener(True)

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.flow_listener is not None:
            self.flow_listener(False)
        if self._timer_kind == "write":
            self._disarm()
            if self._keep_alive:
                self._arm(self.limits.keepalive_timeout_s, self._idle_expired, "idle")
            else:
                self.transport.close()
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_result(None)

    async def drain(self) -> None:
        if self.closed:
            raise ConnectionResetError("client went away")
        if self.write_paused:
            waiter = self._drain_waiter = self.loop.create_future()
            timer = self.loop.call_later(self.limits.write_timeout_s, _stalled, waiter)
            try:
                await waiter
            finally:
                timer.cancel()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def _arm(self, delay_s: float, callback: Callable[[], None], kind: str) -> None:
        self._disarm()
        self._timer = self.loop.call_later(delay_s, callback)
        self._timer_kind = kind

    def _arm_once(self, delay_s: float, callback: Callable[[], None], kind: str) -> None:
        """Deadlines for reading count from the phase's start: more bytes do not extend them,
        so a client that drips its request cannot hold the connection forever."""
        if self._timer_kind != kind:
            self._arm(delay_s, callback, kind)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_kind = ""

    def _idle_expired(self) -> None:
        self._timer, self._timer_kind = None, ""
        if self.handler_task is None and not self._buffer:
            if self.write_paused:
                self.abort()  # close() would wait for a client that does not read
            else:
                self.transport.close()

    def _write_expired(self) -> None:
        self._timer, self._timer_kind = None, ""
        if self.write_paused and self.handler_task is None:
            self.abort()  # an answer the client would not take: let go of it

    def _read_expired(self) -> None:
        self._timer, self._timer_kind = None, ""
        if self.handler_task is None:
            self._refuse(HttpError(408, "the request was not received in time", "request_timeout"))

    # reading -----------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self._buffer += data
        if self.handler_task is not None:
            # Pipelined: the next request waits for this one's answer, in the kernel's buffers
            # rather than ours.
            if len(self._buffer) > self.limits.max_header_bytes:
                self.transport.pause_reading()
                self._reading_paused = True
            return
        try:
            self._process()
        except HttpError as exc:
            self._refuse(exc)
        except Exception:  # a parsing bug must cost one connection an answer, not the answer
            log.exception("could not read a request from %s", self.peer)
            self._refuse(HttpError(400, "malformed request", "bad_request"))

    def _process(self) -> None:
        while self.handler_task is None and not self.closed:
            if self._request is None:
                if not self._read_head():
                    return
                if self._request is None:
                    continue  # refused on its head alone
            if not self._read_body():
                return
            request, self._request = self._request, None
            assert request is not None
            request.body = b"".join(self._body_parts) if len(self._body_parts) != 1 else self._body_parts[0]
            self._body_parts = []
            self._disarm()
            self.response_started = False
            self.handler_task = self.loop.create_task(self._run(request))

    def _read_head(self) -> bool:
        buf = self._buffer
        # Stray CRLFs between requests are tolerated (RFC 9112 §2.2).
        while buf[:2] == b"\r\n":
            del buf[:2]
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > self.limits.max_header_bytes:
                raise HttpError(431, "request headers are larger than limits.max_header_bytes",
                                "headers_too_large")
            if buf:
                self._arm_once(self.limits.header_timeout_s, self._read_expired, "head")
            return False
        if end > self.limits.max_header_bytes:
            raise HttpError(431, "request headers are larger than limits.max_header_bytes",
                            "headers_too_large")
        head = bytes(buf[:end])
        del buf[: end + 4]
        request_line, _, block = head.partition(b"\r\n")
        match = _REQUEST_LINE.fullmatch(request_line)
        if match is None:
            raise HttpError(400, "malformed request line", "bad_request")
        if block and _HEADER_BLOCK.fullmatch(block + b"\r\n") is None:
            raise HttpError(400, "malformed header line or invalid character in a header",
                            "bad_request")
        method, target, version = (part.decode("latin-1") for part in match.groups())
        lines = block.decode("latin-1").split("\r\n") if block else []
        if len(lines) > self.limits.max_headers:
            raise HttpError(431, "too many request headers", "headers_too_large")
        headers: Headers = []
        end_to_end: Headers = []
        lookup: dict[str, str] = {}
        for line in lines:
            name, _, value = line.partition(":")
            value = value.strip(" \t")
            headers.append((name, value))
            lower = name.lower()
            if lower not in CONNECTION_HEADERS:
                end_to_end.append((name, value))
            if lower in lookup:
                if lower == "content-length" and lookup[lower] != value:
                    raise HttpError(400, "conflicting Content-Length headers", "bad_request")
                lookup[lower] = f"{lookup[lower]}, {value}"
            else:
                lookup[lower] = value
        request = Request(method, target, version, headers, lookup, self)
        request.end_to_end_headers = end_to_end
        self._frame_body(request, lookup, version)
        expects_body = self._chunked or self._body_left > 0
        admit = self.server.admit
        refusal = admit(request) if admit is not None else None
        if refusal is not None:
            self._answer_refusal(request, refusal, expects_body)
            return not self.closed
        if self._body_left:
            self._reserve_body(self._body_left)
        if expects_body and lookup.get("expect", "").lower() == "100-continue":
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self._request = request
        return True

    def _answer_refusal(self, request: Request, answer: Answer, expects_body: bool) -> None:
        """Refused on its head: the body, if any, is never read, so the connection closes
        after the answer; a request without one leaves the connection usable."""
        status, headers, body = answer
        if expects_body:
            self._keep_alive = False
        self.response_started = False
        self.write_response(request, status, headers, body)
        if not self._keep_alive:
            self.transport.close()
            self.closed = True
            self._drop_input()
        else:
            self._arm(self.limits.keepalive_timeout_s, self._idle_expired, "idle")

    def _frame_body(self, request: Request, lookup: dict[str, str], version: str) -> None:
        connection = lookup.get("connection", "").lower()
        if version == "HTTP/1.0":
            self._keep_alive = "keep-alive" in connection
        else:
            self._keep_alive = "close" not in connection
        transfer_encoding = lookup.get("transfer-encoding")
        length_text = lookup.get("content-length")
        self._body_parts, self._body_size = [], 0
        if transfer_encoding is not None:
            if length_text is not None:
                raise HttpError(400, "both Transfer-Encoding and Content-Length", "bad_request")
            if transfer_encoding.strip().lower() != "chunked":
                raise HttpError(501, f"unsupported Transfer-Encoding {transfer_encoding!r}",
                                "unsupported_transfer_encoding")
            self._chunked, self._body_left = True, 0
            self._decoder = ChunkedDecoder(max_trailer_bytes=self.limits.max_header_bytes)
        else:
            self._chunked = False
            if length_text is None:
                self._body_left = 0
            elif not (length_text.isascii() and length_text.isdigit()) or len(length_text) > 15:
                raise HttpError(400, f"invalid Content-Length {length_text!r}", "bad_request")
            else:
                self._body_left = int(length_text)
            if self._body_left > self.limits.max_body_bytes:
                raise HttpError(413, f"{self._body_left} bytes exceeds limits.max_body_bytes "
                                     f"({self.limits.max_body_bytes} bytes)", "request_too_large")

    def _take_body(self, data: bytes | bytearray) -> None:
        self._body_size += len(data)
        if self._body_size > self.limits.max_body_bytes:
            raise HttpError(413, f"the request body exceeds limits.max_body_bytes "
                                 f"({self.limits.max_body_bytes} bytes)", "request_too_large")
        if self._chunked:
            self._reserve_body(len(data))  # unknown in advance: counted as it arrives
        self._body_parts.append(bytes(data))

    def _read_body(self) -> bool:
        buf = self._buffer
        if not self._chunked:
            if self._body_left:
                take = min(self._body_left, len(buf))
                if take:
                    self._take_body(buf[:take])
                    del buf[:take]
                    self._body_left -= take
                if self._body_left:
                    self._arm_once(self.limits.body_timeout_s, self._read_expired, "body")
                    return False
            return True
        # Chunked: the decoder takes everything buffered; what follows the body (a pipelined
        # request) comes back once the body has ended.
        data, self._buffer = bytes(buf), bytearray()
        try:
            pieces, rest = self._decoder.feed(data)
        except ChunkedError as exc:
            too_large = isinstance(exc, ChunkedTooLarge)
            status, code = (431, "headers_too_large") if too_large else (400, "bad_request")
            raise HttpError(status, str(exc), code) from None
        for piece in pieces:
            self._take_body(piece)
        if self._decoder.done:
            self._buffer += rest
            return True
        self._arm_once(self.limits.body_timeout_s, self._read_expired, "body")
        return False

    def _refuse(self, exc: HttpError) -> None:
        """Answer a request that could not be read, then close: its framing cannot be trusted."""
        if self.closed:
            return
        self.server.refusals[exc.code] += 1
        self._keep_alive = False
        self.response_started = False
        headers, body = self.server.error_body(exc.status, exc.message, exc.code, self._request)
        if exc.retry_after is not None:
            headers = [*headers, ("Retry-After", str(exc.retry_after))]
        self._write_head(exc.status, headers, len(body), close=True, body=body)
        self.transport.close()
        self.closed = True
        self._drop_input()

    # running and answering ----------------------------------------------------------------------

    async def _run(self, request: Request) -> None:
        try:
            await self.server.handler(request)
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("unhandled error answering %s %s", request.method, request.path)
            if not self.response_started and not self.closed:
                headers, body = self.server.error_body(
                    500, "internal error in the balancer", "internal_error", request
                )
                self.write_response(request, 500, headers, body)
            else:
                self.abort()
        finally:
            if not self.response_started and not self.closed:
                self.abort()  # a handler that never answered must not leave the client hanging
            self.handler_task = None
            self._release_body()
            if not self.closed:
                if self._keep_alive:
                    if self._reading_paused:
                        self._reading_paused = False
                        self.transport.resume_reading()
                    if self._buffer:
                        try:
                            self._process()
                        except HttpError as exc:
                            self._refuse(exc)
                    if self.handler_task is None and self._timer is None:
                        if self.write_paused:
                            self._arm(self.limits.write_timeout_s, self._write_expired, "write")
                        else:
                            self._arm(self.limits.keepalive_timeout_s, self._idle_expired, "idle")
                elif self.write_paused:
                    # The answer is still queued for a client that is slow to read: it gets
                    # write_timeout_s to take it, as a stream's client would.
                    self._arm(self.limits.write_timeout_s, self._write_expired, "write")
                else:
                    self.transport.close()

    def _write_head(self, status: int, headers: Iterable[tuple[str, str]], length: int | None,
                    *, close: bool = False, chunked: bool = False, body: bytes = b"") -> None:
        """Write the status line and headers, and `body` with them: one write, one syscall."""
        reason = _REASONS.get(status, "Unknown")
        parts = [f"HTTP/1.1 {status} {reason}\r\n"]
        has_date = False
        for name, value in headers:
            parts.append(f"{name}: {value}\r\n")
            if not has_date and len(name) == 4 and name.lower() == "date":
                has_date = True
        if length is not None:
            parts.append(f"Content-Length: {length}\r\n")
        elif chunked:
            parts.append("Transfer-Encoding: chunked\r\n")
        if close or not self._keep_alive or self.server.closing:
            self._keep_alive = False
            parts.append("Connection: close\r\n")
        head = "".join(parts).encode("latin-1")
        # Only once the head could be encoded: until then an error can still be answered.
        self.response_started = True
        if not has_date:
            head += b"Date: " + self.server.date_header(time.time()) + b"\r\n"
        if len(body) < 65536:
            self.transport.write(head + b"\r\n" + body)
        else:
            self.transport.writelines((head, b"\r\n", body))

    def write_response(self, request: Request, status: int, headers: Iterable[tuple[str, str]],
                       body: bytes) -> None:
        if self.closed:
            return
        self._write_head(status, headers, len(body), body=b"" if request.method == "HEAD" else body)

    def start_stream(self, request: Request, status: int, headers: Iterable[tuple[str, str]],
                     content_length: int | None) -> ResponseStream:
        if self.closed:
            raise ConnectionResetError("client went away")
        chunked = content_length is None and request.version != "HTTP/1.0"
        if content_length is None and not chunked:
            self._keep_alive = False  # HTTP/1.0: the end of the body is the end of the connection
        self._write_head(status, headers, content_length, chunked=chunked)
        return ResponseStream(self, chunked)


def _stalled(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(ClientStalled("the client did not read its answer in time"))
