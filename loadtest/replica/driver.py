"""Drives an `Engine` in real time on an asyncio loop, `time_scale` times faster than the model.

A loop timer steps the engine and fires again at the iteration's end, when it makes that
iteration's tokens visible to the waiting handlers and steps the next one. Iterations are anchored to the model schedule: when
the process wakes late, the next timer is sooner, so small lags do not add up and the model
timeline stays exact. Only when it falls more than `SLIP_LIMIT_S` of real time behind does the
engine restart from the present, and that slip is counted: it means this process cannot keep
up and measured latencies are longer than the model's.

Handlers never read a sequence's counters directly: the engine applies an iteration when it
plans it, so `seq.num_generated` runs one iteration ahead of what has "happened" yet. They
read their `TokenListener`, which the loop updates at each iteration's end.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
from collections import deque
from collections.abc import Callable
from typing import Any

from loadtest.replica.engine import Engine, EngineSequence, Iteration, Status

SLIP_LIMIT_S = 0.05
FINISHED = Status.FINISHED

log = logging.getLogger("kvlb.replica")


class TokenListener:
    """One request's view of its progress, updated at the end of each iteration.

    Its sequence points at it (`seq.owner`), not the other way round: a cycle would leave
    every finished request's prompt tokens to the cycle collector instead of freeing them
    as the request ends.
    """

    __slots__ = ("delivered", "done", "every_token", "sink", "_waiter")

    def __init__(self, every_token: bool) -> None:
        self.delivered = 0  # tokens produced so far, in real time
        self.done = False
        # Streams wake per token; plain requests only when they finish.
        self.every_token = every_token
        # Optional direct consumer called at each publish; True means it took the tokens and
        # the handler need not wake (see streaming.py).
        self.sink: Callable[[int, bool], bool] | None = None
        self._waiter: asyncio.Future[None] | None = None

    async def wait(self) -> None:
        """Until the next publish that concerns this listener."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiter = waiter
        try:
            await waiter
        finally:
            self._waiter = None

    def publish(self, delivered: int, done: bool) -> None:
        self.delivered = delivered
        self.done = done
        sink = self.sink
        if sink is not None and sink(delivered, done):
            return
        waiter = self._waiter
        if waiter is not None and (self.every_token or done) and not waiter.done():
            waiter.set_result(None)


class RealtimeDriver:
    """Steps the engine from loop timers: one `call_at` per iteration, no task per iteration,
    since this loop runs hundreds of times a second per replica."""

    def __init__(self, engine: Engine, time_scale: float = 1.0, lag_samples: int = 8192) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be positive")
        self.engine = engine
        self.time_scale = time_scale
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.Handle | None = None
        self._in_flight: Iteration | None = None  # stepped, its end not yet reached
        self._target = 0.0  # loop time at which `_in_flight` ends
        self._origin = 0.0
        # The context each timer callback runs in, made once: a loop timer otherwise copies
        # the current context on every iteration.
        self._context: contextvars.Context | None = None
        self.failed: BaseException | None = None
        # Real-time lateness of each iteration's delivery, most recent last (bounded).
        self._lags: deque[float] = deque(maxlen=lag_samples)
        self.max_lag_s = 0.0
        self.slipped_model_s = 0.0
        self.iterations = 0
        self.busy_model_s = 0.0
        # Called as each iteration ends, before its tokens are delivered (the KV events
        # publisher sends what the iteration did to the cache then, as vLLM does after each
        # step's forward pass).
        self.on_iteration_end: Callable[[], None] | None = None

    @property
    def running(self) -> bool:
        return self._loop is not None and self.failed is None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._origin = self._loop.time()
        self._context = contextvars.copy_context()

    async def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._loop = None

    def model_now(self) -> float:
        assert self._loop is not None, "driver not started"
        return (self._loop.time() - self._origin) * self.time_scale

    def submit(
        self,
        tokens: list[str],
        max_tokens: int,
        listener: TokenListener,
        request_id: str = "",
        adapter: str | None = None,
        kv_transferred: bool = False,
    ) -> EngineSequence:
        seq = self.engine.submit(
            tokens,
            max_tokens,
            self.model_now(),
            request_id=request_id,
            owner=listener,
            adapter=adapter,
            kv_transferred=kv_transferred,
        )
        if self._timer is None and self._loop is not None and self.failed is None:
            self._timer = self._loop.call_soon(self._tick, context=self._context)
        return seq

    def abort(self, seq: EngineSequence) -> None:
        self.engine.abort(seq)

    def _tick(self) -> None:
        self._timer = None
        try:
            self._advance()
        except Exception as error:  # pragma: no cover - a bug; /health reports it
            self.failed = error
            log.exception("engine loop failed")

    def _advance(self) -> None:
        loop = self._loop
        if loop is None:
            return
        iteration = self._in_flight
        if iteration is not None:
            self._in_flight = None
            lag = loop.time() - self._target
            self._lags.append(lag)
            if lag > self.max_lag_s:
                self.max_lag_s = lag
            self.iterations += 1
            self.busy_model_s += iteration.duration
            on_end = self.on_iteration_end
            if on_end is not None:
                on_end()
            self._deliver(iteration.emitted)
        engine = self.engine
        start = engine.next_step_time()
        if start is None:
            return  # idle until the next submit
        now = (loop.time() - self._origin) * self.time_scale
        if now - start > SLIP_LIMIT_S * self.time_scale:
            self.slipped_model_s += now - start
            start = now
        iteration = engine.step(start)
        if iteration is None:  # pragma: no cover - the engine always makes progress
            return
        self._in_flight = iteration
        self._target = self._origin + iteration.end / self.time_scale
        self._timer = loop.call_at(self._target, self._tick, context=self._context)

    @staticmethod
    def _deliver(emitted: list[EngineSequence]) -> None:
        """Publish an iteration's tokens: TokenListener.publish, inlined, as this runs once
        per token."""
        for seq in emitted:
            listener = seq.owner
            if listener is None:
                continue
            delivered = listener.delivered = seq.num_generated
            done = listener.done = seq.status is FINISHED
            sink = listener.sink
            if sink is not None and sink(delivered, done):
                continue
            waiter = listener._waiter
            if waiter is not None and (listener.every_token or done) and not waiter.done():
                waiter.set_result(None)

    def stats(self) -> dict[str, Any]:
        """Whether this process keeps up with the model's clock."""
        lags = sorted(self._lags)

        def quantile(q: float) -> float:
            if not lags:
                return 0.0
            return lags[min(len(lags) - 1, math.ceil(q * len(lags)) - 1)]

        return {
            "time_scale": self.time_scale,
            "iterations": self.iterations,
            "busy_model_seconds": self.busy_model_s,
            "slipped_model_seconds": self.slipped_model_s,
            "lag_seconds": {
                "samples": len(lags),
                "mean": sum(lags) / len(lags) if lags else 0.0,
                "p50": quantile(0.5),
                "p99": quantile(0.99),
                "max": self.max_lag_s,
            },
        }

    def reset_stats(self) -> None:
        self._lags.clear()
        self.max_lag_s = 0.0
        self.slipped_model_s = 0.0
        self.iterations = 0
        self.busy_model_s = 0.0
