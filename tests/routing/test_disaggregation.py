"""Choosing the pair: the decode replica by its batch, its KV room and the link from the
prefill replica; one replica instead when the prompt is mostly cached or a pool is empty."""

from __future__ import annotations

from balancer.config import DisaggregationSettings, ReplicaSettings
from balancer.routing.disaggregation import (
    COLOCATED_CACHED,
    COLOCATED_NO_PAIR,
    colocate,
    link_gbps,
    pools,
    rank_decode,
    transfer_ms,
)
from balancer.routing.fleet import Replica

SETTINGS = DisaggregationSettings()


def replica(name: str, role: str, **labels: str) -> Replica:
    return Replica(ReplicaSettings(url=f"http://127.0.0.1:9000/{name}", name=name, role=role, labels=labels))


def test_pools_by_role_and_with_vllm_any_replica_can_serve_alone() -> None:
    fleet = [replica("p", "prefill"), replica("d", "decode"), replica("b", "both")]
    sglang, vllm = pools(fleet, "sglang"), pools(fleet, "vllm")
    assert [r.name for r in sglang.prefill] == ["p"] and [r.name for r in sglang.decode] == ["d"]
    assert [r.name for r in sglang.whole] == ["b"]
    assert [r.name for r in vllm.whole] == ["p", "d", "b"]


def test_a_mostly_cached_prompt_runs_whole_where_it_can_and_a_missing_pool_leaves_no_pair() -> None:
    both = pools([replica("p", "prefill"), replica("d", "decode"), replica("b", "both")], "sglang")
    assert colocate(both, 8000, 7800, SETTINGS) == COLOCATED_CACHED
    assert colocate(both, 8000, 0, SETTINGS) is None
    only_split = pools([replica("p", "prefill"), replica("d", "decode")], "sglang")
    assert colocate(only_split, 8000, 7800, SETTINGS) is None  # nothing could take it whole
    no_decode = pools([replica("p", "prefill"), replica("b", "both")], "sglang")
    assert colocate(no_decode, 8000, 0, SETTINGS) == COLOCATED_NO_PAIR


def test_the_link_is_faster_the_closer_the_pair() -> None:
    p = replica("p", "prefill", host="h1", zone="z1")
    same_host, same_zone, far = (replica("a", "decode", host="h1", zone="z1"),
                                 replica("b", "decode", host="h2", zone="z1"),
                                 replica("c", "decode", host="h3", zone="z2"))
    assert link_gbps(p, same_host, SETTINGS) > link_gbps(p, same_zone, SETTINGS) > link_gbps(p, far, SETTINGS)
    # 8k tokens of llama-3.1-8b (1 GiB of KV) over 100 Gb/s: about 86 ms.
    assert 80 < transfer_ms(8192, 100.0, SETTINGS) < 90
    ranked = rank_decode([far, same_zone, same_host], p, 8192, 100, SETTINGS, [0.0, 0.0, 0.0])
    assert [c.replica.name for c in ranked] == ["a", "b", "c"]
    assert ranked[0].terms["transfer_ms"] < ranked[-1].terms["transfer_ms"]


def test_a_busier_decode_batch_and_a_full_kv_cache_rank_later() -> None:
    p = replica("p", "prefill")
    idle, busy = replica("idle", "decode"), replica("busy", "decode")
    busy.decoding, busy.context_tokens = 64, 64 * 4000
    ranked = rank_decode([busy, idle], p, 4000, 300, SETTINGS, [0.0, 0.0])
    assert [c.replica.name for c in ranked] == ["idle", "busy"]
    full = Replica(ReplicaSettings(url="http://127.0.0.1:9000/full", name="full", role="decode",
                                   kv_capacity_tokens=5000))
    full.context_tokens = 3000
    ranked = rank_decode([full, busy], p, 4000, 300, SETTINGS, [0.0, 0.0])
    assert ranked[-1].replica.name == "full"
