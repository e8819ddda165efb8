"""Slowloris: clients that send a request head a byte at a time, forever."""

from __future__ import annotations

from collections import Counter

from tests.abuse.harness import RSS_SLACK, MiB
from tests.abuse.slowloris import DRIPPERS, HEADER_TIMEOUT_S


def test_clients_dripping_header_bytes_get_408_in_time_and_others_are_served(slowloris) -> None:
    outcome = slowloris.wait(HEADER_TIMEOUT_S + 30)
    slowloris.stop()  # its kvlb has nothing left to show; the rest of the run need not carry it
    assert not outcome.error, outcome.error
    statuses = Counter(status for status, _ in outcome.answers)
    assert statuses == {408: DRIPPERS}, f"{DRIPPERS} dripping heads were answered {dict(statuses)}"
    latest = max(elapsed for _, elapsed in outcome.answers)
    assert latest <= HEADER_TIMEOUT_S + 3, f"the last 408 came {latest:.1f} s after its head began"
    assert not outcome.good_failures, f"the well-behaved client failed: {outcome.good_failures[:4]}"
    assert outcome.good_ok >= 20, f"the well-behaved client got only {outcome.good_ok} answers"
    assert outcome.final_rss <= outcome.baseline_rss + RSS_SLACK, (
        f"kvlb's RSS went from {outcome.baseline_rss / MiB:.0f} to {outcome.final_rss / MiB:.0f} MiB")
    assert slowloris.kvlb.alive()
