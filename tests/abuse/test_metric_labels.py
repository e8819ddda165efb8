"""Metric labels come from bounded sets, whatever clients write into their requests."""

from __future__ import annotations

import asyncio

from tests.abuse.harness import (
    CHAT,
    JSON,
    GoodClient,
    RawConn,
    chat_body,
    scrape,
    sim_replicas,
    under_attack,
)


async def test_model_names_from_requests_do_not_become_metric_labels(kvlb, upstream, sim) -> None:
    # A replica that does not list its models serves whatever name it is sent.
    anything = upstream(models=None)
    k = kvlb({"replicas": [{"url": anything.url, "name": "anything"}, *sim_replicas(sim)]})
    async with under_attack(k, GoodClient(k.port)):

        async def send(first: int) -> list[int]:
            conn = await RawConn.open(k.port)
            statuses = []
            for i in range(first, 300, 4):
                answer = await conn.request("POST", CHAT, chat_body(f"made-up-{i}"), [JSON])
                statuses.append(answer.status)
            conn.close()
            return statuses

        statuses = [s for part in await asyncio.gather(*(send(i) for i in range(4))) for s in part]
        assert statuses == [200] * 300, f"the replica that lists no models did not serve them all: {set(statuses)}"
        models = set((await scrape(k.port)).by("kvlb_requests_total", "model"))
        assert len(models) <= 5, f"{len(models)} model label values, e.g. {sorted(models)[:8]}"
        assert "other" in models, sorted(models)
