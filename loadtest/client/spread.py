"""Load over several balancer instances at once, round-robin by request, as a front load
balancer (DNS, an L4 balancer, a Kubernetes Service) would spread clients over them."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from loadtest.client.runner import run_load
from loadtest.client.summary import RequestRecord
from loadtest.client.workloads import WorkRequest


async def run_spread(
    targets: Sequence[str], requests: Sequence[WorkRequest], **options: Any
) -> tuple[list[RequestRecord], dict[str, Any]]:
    """Request i goes to target i mod len(targets), each still at its own arrival time; the
    records come back merged in request order, with the longest run's meta."""
    shares = [list(requests[i :: len(targets)]) for i in range(len(targets))]
    results = await asyncio.gather(*(
        run_load(target, share, **options) for target, share in zip(targets, shares, strict=True) if share
    ))
    records = sorted((record for recs, _ in results for record in recs), key=lambda r: r.index)
    meta = max((meta for _, meta in results), key=lambda m: m["duration_s"])
    meta["targets"] = list(targets)
    meta["concurrency_cap_hits"] = sum(m["concurrency_cap_hits"] for _, m in results)
    return records, meta
