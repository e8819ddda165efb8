"""The radix prefix index (balancer/routing/index.py), on a fake clock."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from balancer.routing.index import PrefixIndex
from balancer.routing.prefix import PrefixHasher

# 4-character blocks of one token each: a prompt is a tuple of 4-character tags.
hasher = PrefixHasher(block_chars=4, tokens_per_char=0.25)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def text(*tags: str) -> str:
    return "".join(tag.ljust(4, ".") for tag in tags)


def path(*tags: str) -> list[int]:
    return hasher.hashes(text(*tags))


def make(**kwargs) -> tuple[PrefixIndex, FakeClock]:
    clock = FakeClock()
    return PrefixIndex(tokens_per_block=1, clock=clock, **kwargs), clock


SYS = ("s0", "s1", "s2", "s3")
CHAT_A = path(*SYS, "a0", "a1", "a2", "a3")
CHAT_B = path(*SYS, "b0", "b1")


def test_match_finds_every_replicas_depth_in_one_walk():
    index, _ = make()
    index.record("full", CHAT_A)
    index.record("half", CHAT_A[:6])
    index.record("system", CHAT_A[:4])
    index.record("branch", CHAT_B)
    index.record("elsewhere", path("x0", "x1"))
    assert index.match(CHAT_A) == {"full": 8, "half": 6, "system": 4, "branch": 4}
    assert index.match(CHAT_B) == {"full": 4, "half": 4, "system": 4, "branch": 6}
    assert index.match(path(*SYS, "a0", "zz")) == {"full": 5, "half": 5, "system": 4,
                                                   "branch": 4}
    assert index.match(path("new")) == {}
    assert index.match([]) == {}
    index.check_invariants()


@pytest.mark.parametrize("depths", [[1], [37], [100], [1, 2, 3], [5, 50, 99, 100],
                                    list(range(1, 101, 7))])
def test_match_is_exact_at_every_depth(depths):
    index, _ = make()
    long = path(*(f"b{i}" for i in range(100)))
    for depth in depths:
        index.record(f"r{depth}", long[:depth])
    assert index.match(long) == {f"r{depth}": depth for depth in depths}


@pytest.mark.parametrize("depth", [10, 100, 300])
def test_a_walk_hashes_only_about_as_deep_as_the_deepest_match(depth):
    index, _ = make()
    long = "".join(f"{i:04d}" for i in range(2000))
    index.record("r", hasher.hashes(long)[:depth])
    index.record("q", hasher.hashes(long)[:depth // 2])
    lazy = hasher.lazy(long)
    assert index.match(lazy) == {"r": depth, "q": depth // 2}
    assert lazy.computed <= max(16, 2 * depth + 2)
    unknown = hasher.lazy("z" * 8000)
    assert index.match(unknown) == {} and unknown.computed == 16


def test_record_accepts_lazy_hashes_and_counts_entries_once():
    index, _ = make()
    index.record("r", hasher.lazy(text(*SYS)))
    index.record("r", path(*SYS))
    index.record("q", path(*SYS[:2]))
    assert index.entries == 6 and index.entries_of("r") == 4 and index.nodes == 4
    index.check_invariants()


def test_capacity_evicts_least_recently_used_leaves_first():
    index, clock = make()
    index.record("r", CHAT_A)  # 8 blocks
    clock.now += 1
    index.record("r", CHAT_B)  # 2 more: the shared system blocks are now refreshed
    index.set_capacity("r", 7)
    # Only chat A's own tail was old, and it goes deepest first.
    assert index.match(CHAT_A) == {"r": 5}
    assert index.match(CHAT_B) == {"r": 6}
    index.check_invariants()
    index.set_capacity("r", 3)
    # Everything left was used at once. Leaves still go first, so a prefix stays.
    assert index.match(CHAT_A) == {"r": 3} and index.match(CHAT_B) == {"r": 3}
    assert index.nodes == 3
    index.check_invariants()


def test_record_refreshes_what_the_replica_already_holds():
    index, clock = make()
    index.record("r", CHAT_A)
    clock.now += 1
    index.record("r", CHAT_B)
    clock.now += 1
    index.record("r", CHAT_A)  # A is fresh again, so B's own blocks are the oldest
    index.set_capacity("r", 8)
    assert index.match(CHAT_A) == {"r": 8}
    assert index.match(CHAT_B) == {"r": 4}


def test_capacity_is_per_replica_and_in_tokens():
    clock = FakeClock()
    index = PrefixIndex(tokens_per_block=16, clock=clock)
    index.set_capacity("small", 16 * 5 + 15)  # 5 whole blocks
    index.record("small", CHAT_A)
    index.record("big", CHAT_A)
    assert index.match(CHAT_A) == {"small": 5, "big": 8}
    index.set_capacity("small", None)
    index.record("small", CHAT_A)
    assert index.entries_of("small") == 8


def test_a_replica_of_unknown_capacity_holds_no_more_than_the_assumed_capacity():
    clock = FakeClock()
    index = PrefixIndex(tokens_per_block=16, clock=clock, default_capacity_tokens=16 * 5)
    index.set_capacity("known", 16 * 8)
    index.record("unknown", CHAT_A)
    index.record("known", CHAT_A)
    assert index.match(CHAT_A) == {"unknown": 5, "known": 8}
    assert index.evicted_capacity == 3


def test_entries_expire_after_ttl_unless_refreshed():
    index, clock = make(ttl_s=60)
    index.record("r", CHAT_A)
    index.record("q", CHAT_B)
    clock.now += 30
    index.record("q", CHAT_B)
    clock.now += 29.9
    assert index.match(CHAT_A) == {"r": 8, "q": 4}
    clock.now += 0.1
    assert index.match(CHAT_A) == {"q": 4}
    assert index.entries == 6 and index.nodes == 6
    clock.now += 30
    assert index.match(CHAT_B) == {}
    assert index.entries == 0 and index.nodes == 0
    index.check_invariants()


def test_truncate_drops_the_unheld_tail_and_everything_under_it():
    index, _ = make()
    sibling = path(*SYS, "a0", "a1", "c2")
    index.record("r", CHAT_A)
    index.record("r", sibling)
    index.record("r", CHAT_B)
    index.record("q", CHAT_A)
    assert index.truncate("r", CHAT_A, 5) == 4  # a1, a2, a3 and the sibling's c2
    assert index.match(CHAT_A) == {"r": 5, "q": 8}
    assert index.match(sibling) == {"r": 5, "q": 6}
    assert index.match(CHAT_B) == {"r": 6, "q": 4}
    assert index.truncate("r", CHAT_A, 5) == 0
    assert index.truncate("r", CHAT_A, 99) == 0
    assert index.truncate("nobody", CHAT_A, 0) == 0
    assert index.truncate("q", CHAT_A, -3) == 8
    assert index.match(CHAT_A) == {"r": 5}
    assert index.entries == 7 and index.nodes == 7
    index.check_invariants()


def test_remove_replica_frees_its_entries_and_empty_nodes():
    index, _ = make()
    index.record("r", CHAT_A)
    index.record("q", CHAT_B)
    index.set_capacity("r", 3)
    assert index.remove_replica("r") == 3
    assert index.remove_replica("r") == 0
    assert index.match(CHAT_A) == {"q": 4}
    assert index.entries == 6 and index.nodes == 6
    index.record("r", CHAT_A)  # back, empty, with the same capacity setting
    assert index.entries_of("r") == 3
    index.remove_replica("r")
    index.remove_replica("q")
    assert index.entries == 0 and index.nodes == 0
    index.check_invariants()


def test_the_budget_evicts_globally_least_recent_entries_leaves_first():
    index, clock = make(max_entries=10)
    index.record("r", CHAT_A)  # 8 entries
    clock.now += 1
    index.record("q", path("x0", "x1"))  # 10
    clock.now += 1
    index.record("q", CHAT_B)  # 16: r's chat A is the oldest, six of it go, tail first
    assert index.entries == 10
    assert index.match(CHAT_A) == {"r": 2, "q": 4}
    assert index.match(path("x0", "x1")) == {"q": 2}
    index.check_invariants()


def test_the_budget_moves_on_to_the_next_oldest_replica():
    index, clock = make(max_entries=9)
    index.record("r", path("a0", "a1"))
    clock.now += 1
    index.record("q", path("b0", "b1", "b2", "b3"))
    clock.now += 1
    index.record("r", path("c0", "c1", "c2", "c3", "c4", "c5"))  # 12: the oldest 3 go
    assert index.match(path("a0", "a1")) == {}
    assert index.match(path("b0", "b1", "b2", "b3")) == {"q": 3}
    assert index.match(path("c0", "c1", "c2", "c3", "c4", "c5")) == {"r": 6}
    index.check_invariants()


@pytest.mark.parametrize("kwargs", [{"tokens_per_block": 0}, {"ttl_s": 0},
                                    {"max_entries": 0}])
def test_bad_settings_are_refused(kwargs):
    settings_ = {"tokens_per_block": 1, "clock": FakeClock(), **kwargs}
    with pytest.raises(ValueError):
        PrefixIndex(**settings_)
    with pytest.raises(ValueError):
        make()[0].set_capacity("r", -1)


# -- random traffic ----------------------------------------------------------------------------

# Prompts from a small tree of tags, so random prompts share prefixes and diverge.
TAGS = st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=12)
REPLICAS = st.sampled_from(["r0", "r1", "r2", "r3", "r4"])
OPERATIONS = st.lists(st.one_of(
    st.tuples(st.just("record"), REPLICAS, TAGS),
    st.tuples(st.just("truncate"), REPLICAS, TAGS, st.integers(0, 12)),
    st.tuples(st.just("remove"), REPLICAS),
    st.tuples(st.just("capacity"), REPLICAS, st.none() | st.integers(0, 20)),
    st.tuples(st.just("wait"), st.floats(0, 40)),
), max_size=60)


def prompt_of(tags: list[str]) -> list[int]:
    return path(*(f"{tag}{depth}" for depth, tag in enumerate(tags)))


def linear_match(index: PrefixIndex, hashes: list[int]) -> dict[str, int]:
    """Reference for `match`: walk every block, keeping the replicas that hold all so far."""
    result: dict[str, int] = {}
    alive: set[str] | None = None
    for depth, h in enumerate(hashes, 1):
        holders = {name for name in index._ids if h in index._lru[index._ids[name]]}
        alive = holders if alive is None else alive & holders
        for name in alive:
            result[name] = depth
    return result


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPERATIONS, st.integers(5, 40))
def test_random_traffic_keeps_the_index_bounded_and_consistent(operations, max_entries):
    index, clock = make(ttl_s=100, max_entries=max_entries)
    for op in operations:
        if op[0] == "record":
            index.record(op[1], prompt_of(op[2]))
        elif op[0] == "truncate":
            index.truncate(op[1], prompt_of(op[2]), op[3])
        elif op[0] == "remove":
            index.remove_replica(op[1])
        elif op[0] == "capacity":
            index.set_capacity(op[1], op[2])
        else:
            clock.now += op[1]
        index.check_invariants()  # includes: entries <= max_entries, within capacities
        if op[0] in ("record", "truncate"):
            hashes = prompt_of(op[2])
            assert index.match(hashes) == linear_match(index, hashes)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(REPLICAS, TAGS, st.none() | st.integers(0, 12)), max_size=40))
def test_without_eviction_match_agrees_with_a_model_of_held_prefixes(operations):
    index, _ = make()
    held: dict[str, set[tuple[str, ...]]] = {}  # replica → prefixes (as tag tuples) it holds
    for replica, tags, keep in operations:
        prefixes = {tuple(tags[:n]) for n in range(1, len(tags) + 1)}
        if keep is None:
            index.record(replica, prompt_of(tags))
            held.setdefault(replica, set()).update(prefixes)
        else:
            index.truncate(replica, prompt_of(tags), keep)
            cut = tuple(tags[:keep + 1])
            if cut in held.get(replica, set()) and len(tags) > keep:
                held[replica] = {p for p in held[replica] if p[:len(cut)] != cut}
        for probe_tags in (tags, tags[:1], [*tags, "a", "b"]):
            expected = {}
            for name, prefixes_held in held.items():
                depth = 0
                while depth < len(probe_tags) and tuple(probe_tags[:depth + 1]) in prefixes_held:
                    depth += 1
                if depth:
                    expected[name] = depth
            assert index.match(prompt_of(probe_tags)) == expected
    assert index.entries == sum(map(len, held.values()))
    index.check_invariants()


def test_forget_older_than_drops_what_an_lru_engine_evicted_first() -> None:
    now = [0.0]
    index = PrefixIndex(tokens_per_block=16, clock=lambda: now[0])
    hasher = PrefixHasher()
    old, mid, new = (hasher.hashes(f"{tag} " * 200) for tag in ("old", "mid", "new"))
    for t, prompt in ((1.0, old), (2.0, mid), (3.0, new)):
        now[0] = t
        index.record("r", prompt)
    assert index.last_use("r", mid[-1]) == 2.0
    assert index.last_use("other", mid[-1]) is None
    removed = index.forget_older_than("r", 2.0)
    assert removed == len(old) + len(mid)
    assert index.match(old) == {} and index.match(mid) == {}
    assert index.match(new) == {"r": len(new)}
    index.check_invariants()


def test_extend_follows_events_and_budget_removal_takes_whole_subtrees():
    index, clock = make(max_entries=10)
    assert not index.extend("r", CHAT_A[3], CHAT_A[4:])  # parent never stored: refused
    assert index.extend("r", None, CHAT_A[:4])
    clock.now += 1
    assert index.extend("r", CHAT_A[3], CHAT_A[4:6])
    clock.now += 1
    assert index.extend("r", CHAT_A[5], CHAT_A[6:])  # decoding on: one block at a time, no walk
    assert index.match(CHAT_A) == {"r": 8}
    index.check_invariants()
    clock.now += 1
    # Over the budget: the oldest entries are the system prompt, a parent of everything.
    # Removing by age must not leave its children orphaned in the index.
    index.extend("q", None, CHAT_B[:4])
    clock.now += 1
    index.extend("q", CHAT_B[3], CHAT_B[4:])
    index.check_invariants()
    # r's system prompt was oldest, so r went whole rather than as a prompt without its start.
    assert index.match(CHAT_A) == {"q": 4}
    assert index.entries == 6 and index.evicted_budget == 8
