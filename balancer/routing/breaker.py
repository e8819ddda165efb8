"""Passive outlier ejection: a circuit breaker per replica, fed by real traffic.

Active health checks see a replica every few seconds; requests see it hundreds of times a
second. Two kinds of evidence take a replica out of the rankings:

- Faults that are the replica's alone, whoever sent the request: a refused connection, no
  answer in time, an invalid or cut answer, 502, 503 or 504. After `consecutive_failures` of
  them in a row the breaker opens.
- 500s, which say as much about the request as about the replica (a body the engine chokes
  on): one client can provoke as many as it likes. They are judged by success rate over the
  last `window_s` (Envoy's success-rate outlier detection is the model): the replica is
  ejected when at least `min_requests` answers in the window succeeded less often than
  `success_threshold`, and the failed ones came from at least `min_clients` different
  clients. One client, one key or one connection cannot eject a replica that keeps
  answering everyone else.

An open breaker keeps the replica out for a back-off that doubles with each ejection in a row
(`base_ejection_s` up to `max_ejection_s`). Then it is half-open: exactly one request goes
through as a probe; success closes the breaker (and resets the back-off), a fault opens it
again for longer. A replica that asks to be left alone (429 or 503 with Retry-After) is held
off for that long, without counting as a failure.

Time is injected: every call takes `now` (monotonic seconds).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STATE_VALUES = {CLOSED: 0.0, OPEN: 1.0, HALF_OPEN: 2.0}
# 2 ** 30 base ejections is already decades: beyond it the back-off stops growing, and the
# float never overflows however long a replica stays bad.
MAX_BACKOFF_EXPONENT = 30
# Answers remembered for the success rate: under heavy traffic the window is the last this
# many answers rather than the last window_s, so memory does not grow with the request rate.
MAX_SAMPLES = 2048


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    consecutive_failures: int = 5
    base_ejection_s: float = 5.0
    max_ejection_s: float = 300.0
    window_s: float = 30.0
    min_requests: int = 20
    min_clients: int = 3
    success_threshold: float = 0.5


class SuccessRate:
    """Answers in a sliding window: how many, how many failed, and from which clients."""

    __slots__ = ("samples", "failures", "failing_clients")

    def __init__(self) -> None:
        self.samples: deque[tuple[float, bool, str]] = deque()
        self.failures = 0
        self.failing_clients: Counter[str] = Counter()

    def add(self, now: float, ok: bool, client: str, window_s: float) -> None:
        samples = self.samples
        samples.append((now, ok, client))
        if not ok:
            self.failures += 1
            self.failing_clients[client] += 1
        horizon = now - window_s
        while samples and (samples[0][0] < horizon or len(samples) > MAX_SAMPLES):
            _, old_ok, old_client = samples.popleft()
            if not old_ok:
                self.failures -= 1
                left = self.failing_clients[old_client] - 1
                if left:
                    self.failing_clients[old_client] = left
                else:
                    del self.failing_clients[old_client]

    def clear(self) -> None:
        self.samples.clear()
        self.failures = 0
        self.failing_clients.clear()


class Breaker:
    __slots__ = ("settings", "failures", "ejections", "open_until", "probe_in_flight",
                 "ejected_total", "answers", "_state")

    def __init__(self, settings: BreakerSettings) -> None:
        self.settings = settings
        self.failures = 0  # faults in a row
        self.ejections = 0  # in a row, for the back-off
        self.ejected_total = 0
        self.open_until = 0.0
        self.probe_in_flight = False
        self.answers = SuccessRate()
        self._state = CLOSED

    def state(self, now: float) -> str:
        if self._state == OPEN and now >= self.open_until:
            self._state = HALF_OPEN
        return self._state

    def allows(self, now: float) -> bool:
        """May a new request be routed here now?"""
        state = self.state(now)
        return state == CLOSED or (state == HALF_OPEN and not self.probe_in_flight)

    def started(self, now: float) -> bool:
        """A request is being sent; in half-open it is the one probe (returns True)."""
        if self.state(now) == HALF_OPEN:
            self.probe_in_flight = True
            return True
        return False

    def abandoned(self) -> None:
        """The probe ended with no verdict (its client left): let another one through."""
        self.probe_in_flight = False

    def succeeded(self) -> None:
        self.failures = 0
        self.ejections = 0
        self.probe_in_flight = False
        self._state = CLOSED

    def failed(self, now: float) -> bool:
        """Count a fault of the replica's own; True when it (re)opened the breaker."""
        self.failures += 1
        probe_failed = self._state == HALF_OPEN
        self.probe_in_flight = False
        if probe_failed or (self._state == CLOSED and self.failures >= self.settings.consecutive_failures):
            self._eject(now)
            return True
        return False

    def answered(self, now: float, ok: bool, client: str) -> bool:
        """An answer the replica gave (`ok` False for a 500) to `client`; True when the
        success rate ejected it."""
        settings = self.settings
        answers = self.answers
        answers.add(now, ok, client, settings.window_s)
        if ok:
            self.succeeded()
            return False
        if self._state == HALF_OPEN:
            self.probe_in_flight = False  # no verdict: a 500 may be the probe's own request
        total = len(answers.samples)
        if (self._state == CLOSED and total >= settings.min_requests
                and (total - answers.failures) / total < settings.success_threshold
                and len(answers.failing_clients) >= settings.min_clients):
            self._eject(now)
            return True
        return False

    def hold_off(self, now: float, seconds: float) -> None:
        """The replica said when to come back (Retry-After): leave it alone until then."""
        seconds = min(max(seconds, 0.0), self.settings.max_ejection_s)
        if seconds > 0 and now + seconds > self.open_until:
            self.probe_in_flight = False
            self._open(now + seconds)

    def _eject(self, now: float) -> None:
        settings = self.settings
        backoff = settings.base_ejection_s * (2 ** min(self.ejections, MAX_BACKOFF_EXPONENT))
        self.ejections += 1
        self.ejected_total += 1
        self.answers.clear()
        self._open(now + min(backoff, settings.max_ejection_s))

    def _open(self, until: float) -> None:
        self._state = OPEN
        self.open_until = until
