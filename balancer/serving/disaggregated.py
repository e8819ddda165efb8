"""Send one request's two halves to a prefill and a decode replica, and relay the decode answer.

Each attempt is a pair: the prefill journey's next replica and the decode journey's next.
Until the client has seen a byte, a failure of either half (no connection, no answer in
time, 429/502/503, a prefill that breaks off) ends the pair and the next attempt sends both
halves again to the next pair, with a fresh room or transfer: a half is never resent on its own,
since the other half's state went with the failed pair. What counts against a replica is
what it did, as in `proxy.py`. A prefill replica's answer other than 200 (a 400 for a bad
request, a 500) is the client's, as a colocated replica's would be: the request is refused
or failed whichever pair it goes to. A 200 prefill answer never reaches the client; it is
read to its end (bounded), and it is what ends the prefill replica's part of the load.
"""

from __future__ import annotations

import asyncio
import contextlib

from balancer.errors import ClientError
from balancer.routing.core import Journey
from balancer.routing.fleet import Replica
from balancer.serving import pd_protocol
from balancer.serving.proxy import (
    ADAPTER_GONE,
    RETRY_STATUSES,
    Outcome,
    Proxy,
    adapter_not_loaded,
    failure_kind,
)
from balancer.serving.usage import counts_of, learnable, parse_json
from balancer.wire.client import UpstreamError, UpstreamResponse
from balancer.wire.server import Headers, Request

# A prefill answer is one token: anything bigger is not one.
PREFILL_ANSWER_LIMIT = 1 << 20


class _PairFailed(Exception):
    def __init__(self, side: str, replica: Replica, kind: str) -> None:
        super().__init__(f"{side} {replica.name}: {kind}")
        self.side, self.replica, self.kind = side, replica, kind


class _PrefillAnswered(Exception):
    """The prefill replica answered other than 200, and not as a replica that cannot take
    the request now (429, 502, 503): it refused the request (400, 413, 422, a 404 that names
    no adapter) or failed at it itself (500). That answer is the client's, as a colocated
    replica's is; the other half would have refused or failed the same. `resp` is open."""

    def __init__(self, replica: Replica, resp: UpstreamResponse) -> None:
        super().__init__(f"prefill {replica.name}: HTTP {resp.status}")
        self.replica, self.resp = replica, resp


class PairForwarder:
    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy

    async def forward(self, request: Request, prefill: Journey, decode: Journey, request_id: str,
                      outcome: Outcome, extra_headers: Headers | None = None) -> None:
        proxy = self.proxy
        core = proxy.core
        loop = asyncio.get_running_loop()
        headers = proxy.headers_for_replicas(request, request_id)
        # Read per request, as the pair was planned: a reload may change it.
        protocol = proxy.settings.disaggregation.protocol
        data = pd_protocol.parse_object(request.body)
        pd_protocol.refuse_reserved(data, protocol)
        if protocol == "sglang":
            pd_protocol.batch_size(data)  # refused before any replica is tried
        failures: list[str] = []
        gone: list[str] = []
        outcome.attempts = decode.attempts
        while True:
            p = core.next_attempt(prefill, loop.time())
            if p is None:
                break
            d = core.next_attempt(decode, loop.time())
            if d is None:
                core.end_attempt(prefill, answered=False, now=loop.time())
                break
            outcome.replica = d.name
            answered = False
            try:
                answered = await self._pair(protocol, request, data, headers, prefill, decode, p, d,
                                            request_id, outcome, extra_headers)
                return
            except _PrefillAnswered as refused:
                await self._relay_prefill_answer(request, refused, prefill, request_id, outcome, extra_headers)
                return
            except _PairFailed as failed:
                failures.append(str(failed))
                journey = prefill if failed.side == "prefill" else decode
                proxy.metrics.count_attempt(failed.replica.name, failed.kind)
                if failed.kind == ADAPTER_GONE:
                    gone.append(failed.replica.name)
                elif failed.kind != "http_429" and core.failed(journey, loop.time()):
                    proxy._ejected(failed.replica, failed.kind)
            finally:
                if prefill.replica is not None:
                    core.end_attempt(prefill, answered=answered, now=loop.time())
                core.end_attempt(decode, answered=answered, now=loop.time())
        if gone and len(gone) == len(failures):
            raise adapter_not_loaded(prefill.features.adapter, gone)
        raise ClientError(502, f"all {len(failures)} pair(s) failed: " + "; ".join(failures),
                          "upstream_failed", type_="upstream_error")

    async def _pair(self, protocol: str, request: Request, data: dict, headers: Headers, prefill: Journey,
                    decode: Journey,
                    p: Replica, d: Replica, request_id: str, outcome: Outcome,
                    extra_headers: Headers | None) -> bool:
        if protocol == "sglang":
            port = p.settings.bootstrap_port
            if port is None:
                raise _PairFailed("prefill", p, "no_bootstrap_port")
            body = pd_protocol.sglang_body(request.body, p.url, port, pd_protocol.rooms_for(data))
            prefill_leg = asyncio.ensure_future(self._prefill_leg(request, headers, body, prefill, p))
            relaying: _PrefillAnswered | None = None
            try:
                return await self._decode_leg(request, headers, body, prefill, decode, d, request_id, outcome,
                                              extra_headers, prefill_leg)
            except _PrefillAnswered as refused:
                relaying = refused
                raise
            finally:
                if not prefill_leg.done():
                    prefill_leg.cancel()
                with contextlib.suppress(BaseException):
                    await prefill_leg
                late = None if prefill_leg.cancelled() else prefill_leg.exception()
                if isinstance(late, _PrefillAnswered) and late is not relaying:
                    late.resp.close()  # the decode half answered first: that answer went out
        answer = await self._prefill_leg(request, headers, pd_protocol.vllm_prefill_body(data), prefill, p)
        params = pd_protocol.vllm_transfer_params(answer)
        if params is None:
            raise _PairFailed("prefill", p, "no_kv_transfer_params")
        body = pd_protocol.vllm_decode_body(request.body, params)
        return await self._decode_leg(request, headers, body, prefill, decode, d, request_id, outcome,
                                      extra_headers, None)

    async def _prefill_leg(self, request: Request, headers: Headers, body: bytes, journey: Journey,
                           replica: Replica) -> bytes:
        proxy = self.proxy
        timeouts = proxy.settings.timeouts
        try:
            resp = await proxy.pool.request(replica.url, request.method, request.target, headers, body,
                                            timeouts.first_byte_s)
        except (TimeoutError, OSError) as exc:
            raise _PairFailed("prefill", replica, failure_kind(exc)) from None
        relayed = False
        try:
            if resp.status == 404 and await proxy.adapter_gone(journey, replica, resp):
                raise _PairFailed("prefill", replica, ADAPTER_GONE)
            if resp.status in RETRY_STATUSES:
                raise _PairFailed("prefill", replica, f"http_{resp.status}")
            if resp.status != 200:
                relayed = True
                raise _PrefillAnswered(replica, resp)
            try:
                async with asyncio.timeout(timeouts.stream_idle_s):
                    answer = await resp.read(PREFILL_ANSWER_LIMIT)
            except (UpstreamError, TimeoutError):
                raise _PairFailed("prefill", replica, "broken_body") from None
        finally:
            if not relayed:
                resp.close()
        now = asyncio.get_running_loop().time()
        proxy.core.first_byte(journey, now)
        if journey.routed is not None and not answer.startswith(b"data:"):
            proxy._learn(journey, replica, learnable(counts_of(parse_json(answer))))
        proxy.metrics.count_attempt(replica.name, "ok")
        return answer

    async def _relay_prefill_answer(self, request: Request, refused: _PrefillAnswered, prefill: Journey,
                                    request_id: str, outcome: Outcome, extra_headers: Headers | None) -> None:
        proxy, resp, replica = self.proxy, refused.resp, refused.replica
        try:
            outcome.replica = replica.name
            outcome.status = resp.status
            outcome.answered = True
            fault = await proxy._relay(request, resp, replica, prefill, request_id, outcome, extra_headers)
            proxy.judge(prefill, replica, resp.status, fault, request.client)
        finally:
            resp.close()

    async def _decode_leg(self, request: Request, headers: Headers, body: bytes, prefill: Journey, journey: Journey,
                          replica: Replica, request_id: str, outcome: Outcome, extra_headers: Headers | None,
                          prefill_leg: asyncio.Future[bytes] | None) -> bool:
        proxy = self.proxy
        sent = asyncio.ensure_future(proxy.pool.request(replica.url, request.method, request.target, headers, body,
                                                        proxy.settings.timeouts.first_byte_s))
        try:
            if prefill_leg is not None:
                # Both halves at once: a prefill that fails first ends the pair without
                # waiting out the decode server's own wait for the KV.
                await asyncio.wait([sent, prefill_leg], return_when=asyncio.FIRST_COMPLETED)
                if prefill_leg.done() and prefill_leg.exception() is not None:
                    if sent.done() and not sent.cancelled() and sent.exception() is None:
                        sent.result().close()  # both at once: the pair ends on the prefill's
                    raise prefill_leg.exception()  # type: ignore[misc]
            resp = await sent
        except (TimeoutError, OSError) as exc:
            raise _PairFailed("decode", replica, failure_kind(exc)) from None
        finally:
            if not sent.done():
                sent.cancel()
                with contextlib.suppress(BaseException):
                    await sent
        try:
            if resp.status in RETRY_STATUSES:
                raise _PairFailed("decode", replica, f"http_{resp.status}")
            if resp.status == 404 and await proxy.adapter_gone(journey, replica, resp):
                raise _PairFailed("decode", replica, ADAPTER_GONE)
            outcome.status = resp.status
            outcome.answered = True
            if resp.status == 200:
                proxy.core.transferred(prefill, journey)
            fault = await proxy._relay(request, resp, replica, journey, request_id, outcome, extra_headers)
            proxy.judge(journey, replica, resp.status, fault, request.client)
            return True
        finally:
            resp.close()
