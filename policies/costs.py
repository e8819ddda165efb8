"""What the cost-ranking policies (cache_aware, predictive) share: checked parameters, the
locality penalty, how saturated the fleet is, and the jittered order with overflow replicas
held back."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from policies.base import Choice

OVERFLOW_TIER = "overflow"

# The shortest candidate backlog, in ms of prefill, at which the fleet counts as half
# saturated (β = 0.5).
BUSY_REFERENCE_MS = 30.0


def saturation(shortest: float, reference: float) -> float:
    """β, between 0 and 1: 0 while some candidate has nothing queued, toward 1 as even the
    shortest backlog grows past `reference` (both in the same unit)."""
    return shortest / (shortest + reference) if shortest > 0 else 0.0


def number_param(name: str, value: Any, unit: str, *, positive: bool = False) -> float:
    """`value` as a float, finite and >= 0 (> 0 when `positive`), else a ValueError."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number ({unit}), got {value!r}")
    number = float(value)
    if not math.isfinite(number) or number < 0 or (positive and number == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be a finite number {bound} ({unit}), got {value!r}")
    return number


def fraction_param(name: str, value: Any, unit: str) -> float:
    """`value` as a float between 0 and 1, else a ValueError."""
    number = number_param(name, value, unit)
    if number > 1.0:
        raise ValueError(f"{name} must be between 0 and 1 ({unit}), got {number!r}")
    return number


def region_penalties(prefix: str, same: Any, other: Any, unit: str) -> tuple[float, float]:
    """The `{prefix}same_region_penalty_{unit}` and `..._other_...` pair, the second >= the first."""
    same_name, other_name = f"same_region_penalty_{prefix}", f"other_region_penalty_{prefix}"
    same_value = number_param(same_name, same, unit)
    other_value = number_param(other_name, other, unit)
    if other_value < same_value:
        raise ValueError(
            f"{other_name} ({unit}) must be >= {same_name}, got {other_value!r} < {same_value!r}"
        )
    return same_value, other_value


def locality(labels: Mapping[str, str], origin: str, same: float, other: float) -> float:
    """The penalty for a replica with `labels` serving a request from region `origin`: none
    when the replica's region is unknown."""
    region = labels.get("region")
    if region is None:
        return 0.0
    return same if region == origin else other


def rank_with_tiers(
    choices: list[Choice],
    keys: list[float],
    overflow: list[int],
    best_committed_wait_ms: float,
    overflow_after_ms: float,
) -> list[Choice]:
    """`choices` by their jittered `keys`, overflow replicas (indices in `overflow`) held back
    behind the committed ones unless the best committed wait exceeds `overflow_after_ms`."""
    order = sorted(range(len(choices)), key=keys.__getitem__)
    if not overflow or best_committed_wait_ms > overflow_after_ms:
        # No overflow tier, or committed capacity is exhausted (or absent, in which case
        # the best committed wait is infinite): everyone competes on cost.
        return [choices[j] for j in order]
    held_back = set(overflow)
    ranked = [choices[j] for j in order if j not in held_back]
    for j in order:
        if j in held_back:
            choice = choices[j]
            choice.terms["tier"] = 1.0  # type: ignore[index]
            ranked.append(choice)
    return ranked
