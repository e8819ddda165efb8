"""Faults a reliability test can switch on: what a sick GPU server looks like from outside.

Set by command flags at start and replaced as a whole by `POST /admin/fault` (`{}` clears).
JSON keys, all optional:

- `error_rate` (0..1): that fraction of generation requests is answered 503 at once. The
  choice is by error diffusion, not dice, so 0.25 fails exactly every fourth request and a
  test can count on it.
- `hang_s` (seconds, real time): generation requests wait this long before the first byte,
  then proceed; changing the faults (e.g. clearing them) releases the waiting ones early.
- `cut_after_tokens` (N >= 0): the connection is dropped, without a final chunk, once a
  request has N tokens; a stream has sent N token chunks by then.
- `unhealthy` (bool): `/health` and `/health_generate` answer 503.
- `exit_after_s` (seconds, real time): the process exits with status 1, without cleanup, as
  a crash would; 0 exits right after the admin reply is sent.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass
from typing import Any


class FaultSpecError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Faults:
    error_rate: float = 0.0
    hang_s: float | None = None
    cut_after_tokens: int | None = None
    unhealthy: bool = False
    exit_after_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, spec: Any) -> Faults:
        if not isinstance(spec, dict):
            raise FaultSpecError("fault spec must be a JSON object")
        unknown = set(spec) - set(cls.__dataclass_fields__)
        if unknown:
            raise FaultSpecError(f"unknown fault(s): {', '.join(sorted(unknown))}")
        error_rate = spec.get("error_rate", 0.0)
        if not _is_number(error_rate) or not 0.0 <= error_rate <= 1.0:
            raise FaultSpecError("error_rate must be a number from 0 to 1")
        hang_s = _optional_seconds(spec, "hang_s")
        exit_after_s = _optional_seconds(spec, "exit_after_s")
        cut = spec.get("cut_after_tokens")
        if cut is not None and (not isinstance(cut, int) or isinstance(cut, bool) or cut < 0):
            raise FaultSpecError("cut_after_tokens must be a non-negative integer")
        unhealthy = spec.get("unhealthy", False)
        if not isinstance(unhealthy, bool):
            raise FaultSpecError("unhealthy must be true or false")
        return cls(float(error_rate), hang_s, cut, unhealthy, exit_after_s)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _optional_seconds(spec: dict[str, Any], key: str) -> float | None:
    value = spec.get(key)
    if value is None:
        return None
    if not _is_number(value) or value < 0:
        raise FaultSpecError(f"{key} must be a non-negative number of seconds")
    return float(value)


class FaultState:
    """The faults in force, plus what acting on them needs (error credit, wake-ups)."""

    def __init__(self, faults: Faults | None = None) -> None:
        self.faults = faults or Faults()
        self._error_credit = 0.0
        self._changed = asyncio.Event()

    def replace(self, faults: Faults) -> None:
        self.faults = faults
        self._error_credit = 0.0
        self._changed.set()
        self._changed = asyncio.Event()

    def should_reject(self) -> bool:
        rate = self.faults.error_rate
        if rate <= 0.0:
            return False
        self._error_credit += rate
        if self._error_credit >= 1.0 - 1e-9:
            self._error_credit -= 1.0
            return True
        return False

    async def hang(self) -> None:
        """Wait out `hang_s`, or less if the faults change meanwhile."""
        seconds = self.faults.hang_s
        if not seconds:
            return
        changed = self._changed
        try:
            await asyncio.wait_for(changed.wait(), timeout=seconds)
        except TimeoutError:
            pass
