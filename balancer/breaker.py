"""Passive outlier ejection: a circuit breaker per replica, fed by real traffic.

Active health checks see a replica every few seconds; requests see it hundreds of times a
second. After `consecutive_failures` connect errors, first-byte timeouts or 5xx answers in a
row the breaker opens and the replica leaves the rankings at once, for a back-off that
doubles with each ejection in a row (`base_ejection_s` up to `max_ejection_s`). Then it is
half-open: exactly one request goes through as a probe; success closes the breaker (and
resets the back-off), failure opens it again for longer. A replica that asks to be left alone
(429 or 503 with Retry-After) is held off for that long, without counting as a failure.

Time is injected: every call takes `now` (monotonic seconds).
"""

from __future__ import annotations

from dataclasses import dataclass

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STATE_VALUES = {CLOSED: 0.0, OPEN: 1.0, HALF_OPEN: 2.0}


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    consecutive_failures: int = 5
    base_ejection_s: float = 5.0
    max_ejection_s: float = 300.0


class Breaker:
    __slots__ = ("settings", "failures", "ejections", "open_until", "probe_in_flight",
                 "ejected_total", "_state")

    def __init__(self, settings: BreakerSettings) -> None:
        self.settings = settings
        self.failures = 0  # in a row
        self.ejections = 0  # in a row, for the back-off
        self.ejected_total = 0
        self.open_until = 0.0
        self.probe_in_flight = False
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
        """Count a failure; True when it (re)opened the breaker."""
        self.failures += 1
        probe_failed = self._state == HALF_OPEN
        self.probe_in_flight = False
        if probe_failed or (self._state == CLOSED and self.failures >= self.settings.consecutive_failures):
            backoff = self.settings.base_ejection_s * (2 ** self.ejections)
            self.ejections += 1
            self.ejected_total += 1
            self._open(now + min(backoff, self.settings.max_ejection_s))
            return True
        return False

    def hold_off(self, now: float, seconds: float) -> None:
        """The replica said when to come back (Retry-After): leave it alone until then."""
        seconds = min(max(seconds, 0.0), self.settings.max_ejection_s)
        if seconds > 0 and now + seconds > self.open_until:
            self.probe_in_flight = False
            self._open(now + seconds)

    def _open(self, until: float) -> None:
        self._state = OPEN
        self.open_until = until
