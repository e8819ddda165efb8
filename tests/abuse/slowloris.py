"""Slowloris on the headers, run in the background of the whole suite.

kvlb gives a request's head 30 s from its first byte (the HTTP server's header_timeout_s, not
a setting), so a test that waits for the 408 takes 30 s. Started when the suite starts, in a
thread with its own event loop, the attack runs while the other tests do, and
test_slowloris.py only collects the outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass, field

from tests.abuse.harness import GoodClient, Kvlb, RawConn, parse_answer, rss_settled, steady_rss

HEADER_TIMEOUT_S = 30.0
DRIPPERS = 50
DRIP_GAP_S = 1.0


@dataclass
class Outcome:
    answers: list[tuple[int | None, float]] = field(default_factory=list)  # (status, s after first byte)
    good_ok: int = 0
    good_failures: list[str] = field(default_factory=list)
    baseline_rss: int = 0
    final_rss: int = 0
    error: str = ""


class Slowloris:
    def __init__(self, kvlb: Kvlb) -> None:
        self.kvlb = kvlb
        self.outcome = Outcome()
        self.done = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._halted = False
        self._thread = threading.Thread(target=self._run, name="slowloris", daemon=True)

    def start(self) -> Slowloris:
        self._thread.start()
        return self

    def wait(self, timeout_s: float) -> Outcome:
        self.done.wait(timeout_s)
        return self.outcome

    def stop(self) -> None:
        self._halted = True  # seen by _main if it has not made its stop event yet
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not self.done.is_set():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
        self._thread.join(20)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported by the test, not lost in a thread
            self.outcome.error = repr(exc)
        finally:
            self.done.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        stop = self._stop = asyncio.Event()
        if self._halted:
            return
        outcome = self.outcome
        good = GoodClient(self.kvlb.port, gap_s=0.1)
        await good.start()
        try:
            outcome.baseline_rss = await steady_rss(self.kvlb.pid)
            drips = [asyncio.create_task(self._drip(stop)) for _ in range(DRIPPERS)]
            try:
                async with asyncio.timeout(HEADER_TIMEOUT_S + 10):
                    outcome.answers = list(await asyncio.gather(*drips))
            except TimeoutError:
                outcome.error = f"drippers still open {HEADER_TIMEOUT_S + 10:g} s after their first byte"
        finally:
            await good.stop()
            outcome.good_ok, outcome.good_failures = good.ok, good.failures
        outcome.final_rss = await rss_settled(self.kvlb.pid, outcome.baseline_rss)

    async def _drip(self, stop: asyncio.Event) -> tuple[int | None, float]:
        """A request head sent a byte a second, never finished: kvlb's answer and when."""
        conn = await RawConn.open(self.kvlb.port)
        closed: asyncio.Task[bytes | None] | None = None
        try:
            await conn.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: kvlb\r\nX-Drip: ")
            began = time.monotonic()
            closed = asyncio.create_task(conn.read_until_closed(HEADER_TIMEOUT_S + 10))
            while not closed.done() and not stop.is_set():
                with contextlib.suppress(ConnectionError):
                    await conn.send(b"a")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(closed), DRIP_GAP_S)
            if not closed.done():
                return None, time.monotonic() - began
            data = closed.result()
            elapsed = time.monotonic() - began
            return ((await parse_answer(data)).status if data else None), elapsed
        finally:
            if closed is not None:
                closed.cancel()
            conn.abort()
