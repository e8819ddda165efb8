"""Baseline routing policies, checked against hand-made fleets."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from policies import consistent_hash as consistent_hash_module
from policies.base import Choice, Policy, ReplicaView, RequestFeatures
from policies.consistent_hash import ConsistentHashPolicy
from policies.least_load import LeastLoadPolicy
from policies.power_of_two import PowerOfTwoPolicy
from policies.random import RandomPolicy
from policies.registry import POLICIES, make_policy
from policies.round_robin import RoundRobinPolicy
from tests.fakes import FakeReplica

BASELINE_NAMES = ["random", "round_robin", "least_load", "power_of_two", "consistent_hash"]
REQUEST = RequestFeatures(route="/v1/chat/completions", model="m")


def make_fleet(n: int, loads: list[int] | None = None, weights: list[float] | None = None):
    loads = loads or [0] * n
    weights = weights or [1.0] * n
    return [FakeReplica(f"r{i}", weight=weights[i], in_flight=loads[i]) for i in range(n)]


def names(choices: list[Choice]) -> list[str]:
    return [c.replica.name for c in choices]


def first_picks(policy: Policy, fleet, calls: int, request=REQUEST) -> Counter[str]:
    return Counter(policy.rank(request, fleet)[0].replica.name for _ in range(calls))


def session(key: str) -> RequestFeatures:
    return RequestFeatures(route="/v1/chat/completions", model="m", session_key=key)


# --- every policy ---------------------------------------------------------------------------


def test_fake_replica_satisfies_the_protocol():
    assert isinstance(FakeReplica("r0"), ReplicaView)


@pytest.mark.parametrize("policy_name", BASELINE_NAMES)
@pytest.mark.parametrize("n", [1, 2, 3, 7, 16])
def test_rank_returns_every_replica_exactly_once_with_float_terms(policy_name, n):
    policy = make_policy(policy_name, seed=7)
    fleet = make_fleet(
        n, loads=[(i * 7) % 5 for i in range(n)], weights=[1.0 + (i % 3) for i in range(n)]
    )
    for call in range(50):
        request = session(f"user-{call}") if call % 2 else REQUEST
        ranking = policy.rank(request, fleet)
        assert len(ranking) == n
        assert sorted(map(id, (c.replica for c in ranking))) == sorted(map(id, fleet))
        for choice in ranking:
            assert isinstance(choice, Choice)
            assert choice.terms
            assert all(isinstance(v, float) for v in choice.terms.values())
        fleet[call % n].in_flight += 1


@pytest.mark.parametrize("policy_name", BASELINE_NAMES)
def test_rank_keeps_every_entry_even_when_names_repeat(policy_name):
    fleet = make_fleet(3) + [FakeReplica("r1", in_flight=2)]
    ranking = make_policy(policy_name, seed=1).rank(session("alice"), fleet)
    assert sorted(map(id, (c.replica for c in ranking))) == sorted(map(id, fleet))


@pytest.mark.parametrize("policy_name", BASELINE_NAMES)
def test_same_seed_gives_same_rankings(policy_name):
    fleet = make_fleet(5)
    a, b = make_policy(policy_name, seed=3), make_policy(policy_name, seed=3)
    assert [names(a.rank(REQUEST, fleet)) for _ in range(20)] == [
        names(b.rank(REQUEST, fleet)) for _ in range(20)
    ]


# --- random ---------------------------------------------------------------------------------


def test_random_first_picks_follow_weights():
    fleet = make_fleet(4, weights=[1.0, 2.0, 3.0, 4.0])
    counts = first_picks(RandomPolicy(seed=1), fleet, 10_000)
    for i, replica in enumerate(fleet):
        share = counts[replica.name] / 10_000
        assert share == pytest.approx((i + 1) / 10, abs=0.02), (replica.name, share)


def test_random_orders_vary_and_ignore_load():
    fleet = make_fleet(3, loads=[100, 0, 0])
    policy = RandomPolicy(seed=2)
    orders = Counter(tuple(names(policy.rank(REQUEST, fleet))) for _ in range(3000))
    assert len(orders) == 6
    assert all(count > 350 for count in orders.values()), orders


# --- round robin ----------------------------------------------------------------------------


def test_round_robin_cycles_exactly_in_the_order_given():
    fleet = make_fleet(3)
    policy = RoundRobinPolicy()
    rankings = [names(policy.rank(REQUEST, fleet)) for _ in range(9)]
    assert [r[0] for r in rankings] == ["r0", "r1", "r2"] * 3
    # Failover continues in cyclic order after the pick.
    assert rankings[:3] == [["r0", "r1", "r2"], ["r1", "r2", "r0"], ["r2", "r0", "r1"]]


def test_round_robin_with_fractional_equal_weights_stays_exact():
    fleet = make_fleet(3, weights=[0.1, 0.1, 0.1])
    policy = RoundRobinPolicy()
    picks = [policy.rank(REQUEST, fleet)[0].replica.name for _ in range(30_000)]
    assert picks == ["r0", "r1", "r2"] * 10_000


def test_round_robin_weighted_shares_are_two_to_one():
    fleet = make_fleet(2, weights=[2.0, 1.0])
    counts = first_picks(RoundRobinPolicy(), fleet, 300)
    assert counts == {"r0": 200, "r1": 100}


def test_round_robin_is_smooth_like_nginx():
    fleet = [FakeReplica("a", 5.0), FakeReplica("b", 1.0), FakeReplica("c", 1.0)]
    policy = RoundRobinPolicy()
    picks = [policy.rank(REQUEST, fleet)[0].replica.name for _ in range(7)]
    assert picks == ["a", "a", "b", "a", "c", "a", "a"]


def test_round_robin_ignores_load():
    fleet = make_fleet(2, loads=[50, 0])
    policy = RoundRobinPolicy()
    assert [policy.rank(REQUEST, fleet)[0].replica.name for _ in range(4)] == ["r0", "r1"] * 2


def test_round_robin_state_stays_bounded_under_replica_churn():
    policy = RoundRobinPolicy()
    for generation in range(3000):
        fleet = [FakeReplica(f"pod-{generation}-{i}") for i in range(3)]
        policy.rank(REQUEST, fleet)
    assert len(policy._current) <= 3 + 1024 + 3


# --- least load -----------------------------------------------------------------------------


def test_least_load_orders_by_in_flight_and_follows_changes():
    fleet = make_fleet(4, loads=[5, 2, 9, 3])
    policy = LeastLoadPolicy(seed=1)
    assert names(policy.rank(REQUEST, fleet)) == ["r1", "r3", "r0", "r2"]
    fleet[1].in_flight = 10
    fleet[2].in_flight = 0
    ranking = policy.rank(REQUEST, fleet)
    assert names(ranking) == ["r2", "r3", "r0", "r1"]
    assert ranking[0].terms == {"in_flight": 0.0, "load": 0.0}


def test_least_load_divides_by_weight():
    fleet = make_fleet(2, loads=[4, 2], weights=[4.0, 1.0])
    ranking = LeastLoadPolicy(seed=1).rank(REQUEST, fleet)
    assert names(ranking) == ["r0", "r1"]
    assert ranking[0].terms["load"] == 1.0


def test_least_load_spreads_ties_at_random():
    fleet = make_fleet(4, loads=[3, 3, 3, 3])
    counts = first_picks(LeastLoadPolicy(seed=5), fleet, 1000)
    assert set(counts) == {"r0", "r1", "r2", "r3"}
    assert min(counts.values()) >= 150, counts


def test_least_load_ties_only_among_the_lightest():
    fleet = make_fleet(4, loads=[1, 0, 2, 0])
    counts = first_picks(LeastLoadPolicy(seed=5), fleet, 1000)
    assert set(counts) == {"r1", "r3"}
    assert min(counts.values()) >= 400, counts


# --- power of two ---------------------------------------------------------------------------


def test_power_of_two_puts_the_lighter_sample_first_then_the_rest_by_load():
    fleet = make_fleet(8, loads=[7, 3, 5, 0, 6, 1, 4, 2])
    policy = PowerOfTwoPolicy(seed=4)
    for _ in range(500):
        ranking = policy.rank(REQUEST, fleet)
        first, second, *rest = ranking
        assert first.terms["sampled"] == second.terms["sampled"] == 1.0
        assert first.replica.in_flight < second.replica.in_flight
        assert all(c.terms["sampled"] == 0.0 for c in rest)
        rest_loads = [c.replica.in_flight for c in rest]
        assert rest_loads == sorted(rest_loads)


def test_power_of_two_first_pick_shares_match_the_theory():
    # With n replicas of distinct loads, the k-th lightest (k from 0) comes first when it is
    # sampled with a heavier one: probability 2 * (n - 1 - k) / (n * (n - 1)).
    fleet = make_fleet(4, loads=[0, 1, 2, 3])
    counts = first_picks(PowerOfTwoPolicy(seed=9), fleet, 6000)
    assert "r3" not in counts
    for k, expected in enumerate([6 / 12, 4 / 12, 2 / 12]):
        assert counts[f"r{k}"] / 6000 == pytest.approx(expected, abs=0.03), counts


def test_power_of_two_spreads_picks_when_loads_are_equal():
    fleet = make_fleet(4, loads=[2, 2, 2, 2])
    policy = PowerOfTwoPolicy(seed=6)
    counts = first_picks(policy, fleet, 1000)
    assert min(counts.values()) >= 150, counts
    seconds = Counter(policy.rank(REQUEST, fleet)[1].replica.name for _ in range(1000))
    assert min(seconds.values()) >= 150, seconds


def test_power_of_two_honours_weight():
    fleet = make_fleet(2, loads=[6, 2], weights=[4.0, 1.0])
    assert names(PowerOfTwoPolicy(seed=1).rank(REQUEST, fleet)) == ["r0", "r1"]


# --- consistent hash ------------------------------------------------------------------------


def home(policy: Policy, fleet, key: str) -> str:
    return policy.rank(session(key), fleet)[0].replica.name


def test_consistent_hash_is_stable_for_a_key_while_loads_are_equal():
    fleet = make_fleet(8, loads=[5] * 8)
    policy = ConsistentHashPolicy(seed=1)
    for key in ["alice", "bob", "carol"]:
        rankings = {tuple(names(policy.rank(session(key), fleet))) for _ in range(50)}
        assert len(rankings) == 1
    # Another balancer instance (another seed) agrees: the ring depends only on the names.
    other = ConsistentHashPolicy(seed=99)
    assert all(home(other, fleet, k) == home(policy, fleet, k) for k in ["alice", "bob"])


def test_consistent_hash_spreads_keys_over_replicas():
    fleet = make_fleet(8)
    policy = ConsistentHashPolicy()
    counts = Counter(home(policy, fleet, f"user-{i}") for i in range(4000))
    assert set(counts) == {f"r{i}" for i in range(8)}
    assert all(250 <= c <= 800 for c in counts.values()), counts


def test_consistent_hash_honours_weight_through_virtual_nodes():
    fleet = make_fleet(4, weights=[1.0, 1.0, 1.0, 3.0])
    policy = ConsistentHashPolicy()
    counts = Counter(home(policy, fleet, f"user-{i}") for i in range(6000))
    assert counts["r3"] / 6000 == pytest.approx(0.5, abs=0.08), counts


def test_consistent_hash_skips_a_replica_over_its_bound_for_the_next_on_the_ring():
    fleet = make_fleet(8, loads=[4] * 8)
    policy = ConsistentHashPolicy(load_factor=1.25)
    unloaded = names(policy.rank(session("alice"), fleet))
    preferred, next_on_ring = unloaded[0], unloaded[1]
    by_name = {r.name: r for r in fleet}
    by_name[unloaded[-1]].in_flight = 3

    # Capacity is ceil(1.25 * (total + 1) / 8), counting the request being routed. With the
    # preferred replica at 5 the total is 32: it still fits, as 5 + 1 <= ceil(5.16) = 6.
    by_name[preferred].in_flight = 5
    ranking = policy.rank(session("alice"), fleet)
    assert ranking[0].replica.name == preferred
    assert ranking[0].terms["capacity"] == math.ceil(1.25 * (32 + 1) / 8) == 6

    # At 6 it would hold 7 > 6, so the request spills to the next replica on the ring, and
    # the overloaded replica moves to the end of the failover order.
    by_name[preferred].in_flight = 6
    spilled = names(policy.rank(session("alice"), fleet))
    assert spilled[0] == next_on_ring
    assert spilled == unloaded[1:] + [preferred]


def test_consistent_hash_higher_load_factor_tolerates_more_imbalance():
    fleet = make_fleet(8, loads=[4] * 8)
    preferred = home(ConsistentHashPolicy(), fleet, "alice")
    next(r for r in fleet if r.name == preferred).in_flight = 8
    assert home(ConsistentHashPolicy(load_factor=1.25), fleet, "alice") != preferred
    assert home(ConsistentHashPolicy(load_factor=2.0), fleet, "alice") == preferred


def test_consistent_hash_removing_one_of_eight_moves_only_its_keys():
    fleet = make_fleet(8)
    policy = ConsistentHashPolicy()
    keys = [f"session-{i}" for i in range(4000)]
    before = {k: home(policy, fleet, k) for k in keys}
    removed = "r5"
    smaller = [r for r in fleet if r.name != removed]
    after = {k: home(policy, smaller, k) for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == removed}
    assert len(moved) / len(keys) == pytest.approx(1 / 8, abs=0.05)
    # A fresh ring of the seven survivors maps keys the same way as the long-lived one.
    fresh = ConsistentHashPolicy()
    assert all(home(fresh, smaller, k) == after[k] for k in keys[:500])


def test_consistent_hash_adding_a_ninth_moves_keys_only_to_it():
    fleet = make_fleet(8)
    policy = ConsistentHashPolicy()
    keys = [f"session-{i}" for i in range(4000)]
    before = {k: home(policy, fleet, k) for k in keys}
    bigger = fleet + [FakeReplica("r8")]
    after = {k: home(policy, bigger, k) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert {after[k] for k in moved} == {"r8"}
    assert len(moved) / len(keys) == pytest.approx(1 / 9, abs=0.05)


def test_consistent_hash_without_a_session_key_starts_at_random():
    fleet = make_fleet(4)
    counts = first_picks(ConsistentHashPolicy(seed=3), fleet, 2000)
    assert min(counts.values()) >= 300, counts


def test_consistent_hash_forgets_replicas_gone_for_a_long_time(monkeypatch):
    monkeypatch.setattr(consistent_hash_module, "_SWEEP_EVERY", 10)
    policy = ConsistentHashPolicy(virtual_nodes=10)
    for generation in range(50):
        fleet = [FakeReplica(f"pod-{generation}-{i}") for i in range(4)]
        for call in range(10):
            policy.rank(session(f"k{call}"), fleet)
    assert len(policy._weights) <= 8
    assert len(policy._points) <= 8 * 10


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"load_factor": 1.0}, "load_factor must be a finite number > 1.0, got 1.0"),
        ({"load_factor": 0.5}, "load_factor must be a finite number > 1.0, got 0.5"),
        ({"load_factor": float("nan")}, "load_factor"),
        ({"load_factor": float("inf")}, "load_factor"),
        ({"load_factor": "1.5"}, "load_factor must be a number"),
        ({"load_factor": True}, "load_factor must be a number"),
        ({"virtual_nodes": 0}, "virtual_nodes must be between 1 and"),
        ({"virtual_nodes": 10**7}, "virtual_nodes must be between 1 and"),
        ({"virtual_nodes": 2.5}, "virtual_nodes must be an integer"),
        ({"virtual_nodes": True}, "virtual_nodes must be an integer"),
        ({"vnodes": 10}, "unknown parameter(s) for policy 'consistent_hash': vnodes"),
    ],
)
def test_consistent_hash_rejects_bad_params(params, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_policy("consistent_hash", params)


def test_consistent_hash_accepts_an_integer_load_factor_from_yaml():
    policy = make_policy("consistent_hash", {"load_factor": 2, "virtual_nodes": 50})
    assert policy.load_factor == 2.0
    assert policy.virtual_nodes == 50


# --- registry -------------------------------------------------------------------------------


def test_registry_knows_the_baseline_policies_by_their_yaml_names():
    assert set(BASELINE_NAMES) <= set(POLICIES)
    for name in BASELINE_NAMES:
        assert POLICIES[name].name == name
        policy = make_policy(name, seed=1)
        assert isinstance(policy, POLICIES[name])


def test_registry_rejects_unknown_names_and_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown policy 'fastest'; known: .*round_robin"):
        make_policy("fastest")


@pytest.mark.parametrize("name", ["random", "round_robin", "least_load", "power_of_two"])
def test_registry_rejects_params_for_policies_without_any(name):
    with pytest.raises(ValueError, match="unknown parameter"):
        make_policy(name, {"load_factor": 1.5})


def test_registry_rejects_seed_inside_params():
    with pytest.raises(ValueError, match="seed"):
        make_policy("random", {"seed": 1})
