"""Routing-cost benchmark: prefix hashing + index walk + scoring, and index memory per entry.

Route time covers hashing the canonical prompt (lazily), `PrefixIndex.match`, and ranking 16
replicas with the real policy (`--policy`, default predictive; balancer.routing.fleet.Replica
objects with random loads). A last part ranks 200 such replicas, 20 of them holding part of
the prompt: what one decision costs on a large fleet (floor 1 ms). Half the replicas have fitted terms that earned trust (balancer/routing/term_fit.py), so
the ranking weighs them. Prompts are synthetic text, 4 characters a token. The index is
filled first with sessions that share a system prompt. Of the routed prompt's own blocks,
2 replicas hold all, 4 hold half, 6 hold the system prompt and 4 hold none (most of those 4
hold the system prompt anyway, through other sessions). Other prompts fill the index to about
a million entries. Then memory: an index filled to 1,000,000 replica x block entries,
measured with tracemalloc and as the change in RSS.

    python -m loadtest.bench.routing [--scale 1.0] [--no-memory] [--policy predictive]

Floors (from the issue): median route <= 150 us at 8k tokens and <= 500 us at 32k;
1,000,000 entries in <= 300 MB.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import subprocess
import sys
import time
import tracemalloc

from balancer.config import ReplicaSettings
from balancer.routing.fleet import Replica
from balancer.routing.index import PrefixIndex
from balancer.routing.prefix import PrefixHasher
from policies.base import RequestFeatures
from policies.registry import make_policy

REPLICAS = [f"gpu-{i:02d}" for i in range(16)]
SIZES = [1_000, 8_000, 32_000, 128_000]  # prompt tokens
ROUTES = {1_000: 3000, 8_000: 1500, 32_000: 500, 128_000: 150}
SESSIONS = {1_000: 32, 8_000: 32, 32_000: 16, 128_000: 8}
ROUNDS = 5  # route timings come in rounds; the spread of round medians shows the noise
FLOORS_US = {8_000: 150.0, 32_000: 500.0}
FLOOR_BYTES_PER_MILLION = 300e6

hasher = PrefixHasher()
_WORDS = ("the cache router prefix block token replica engine prompt session model answer "
          "system user tool call value request stream batch queue latency memory").split()


def synthetic_text(tokens: int, rng: random.Random) -> str:
    """`tokens` x 4 characters of word-like text."""
    chars = tokens * 4
    words = rng.choices(_WORDS, k=chars // 5 + 8)
    return " ".join(words)[:chars].ljust(chars, ".")


def fill(index: PrefixIndex, rng: random.Random) -> dict[int, list[tuple[str, str]]]:
    """Sessions for every size plus background traffic. Returns per size the routable
    prompts, each with a fresh follow-up that shares only the system prompt."""
    routable: dict[int, list[tuple[str, str]]] = {}
    for size in SIZES:
        system = synthetic_text(size // 8, rng)
        routable[size] = []
        for _ in range(SESSIONS[size]):
            prompt = system + synthetic_text(size - size // 8, rng)
            hashes = hasher.hashes(prompt)
            order = rng.sample(REPLICAS, len(REPLICAS))
            for name in order[:2]:
                index.record(name, hashes)
            for name in order[2:6]:
                index.record(name, hashes[:len(hashes) // 2])
            for name in order[6:12]:
                index.record(name, hashes[:len(hashes) // 8])
            # order[12:] hold none of this session's own blocks.
            new_session = system + synthetic_text(size - size // 8, rng)
            routable[size].append((prompt, new_session))
    background_text = synthetic_text(2_000, rng)
    while index.entries < 1_000_000:
        # Distinct 2k-token prompts: a unique first block makes every chain distinct.
        prompt = f"{rng.getrandbits(64):064x}" + background_text
        index.record(rng.choice(REPLICAS), hasher.hashes(prompt))
    return routable


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def teach_terms(replicas: list[Replica], rng: random.Random) -> None:
    """Half the replicas fitted, term by term, as a card of another shape than the profile
    (attention a quarter of it), so that ranking weighs fitted terms in the timed path."""
    for replica in replicas[::2]:
        for _ in range(40):
            n = rng.randint(500, 32_000)
            parts = ((1.5 + n / 8192) * 5.3, n * 0.0191, 7.4e-7 * n * n / 2)
            replica.ttft_terms_fit.observe(parts[0] + parts[1] + parts[2] / 4, parts)
            decode = (8.6, 4.39e-5 * rng.randint(10_000, 400_000))
            replica.itl_terms_fit.observe(decode[0] + decode[1] / 2, decode)
        assert replica.ttft_terms is not None and replica.itl_terms is not None


def bench_routes(scale: float, policy_name: str = "predictive") -> dict[int, float]:
    rng = random.Random(7)
    clock = time.monotonic
    index = PrefixIndex(tokens_per_block=hasher.tokens_per_block, clock=clock)
    started = time.perf_counter()
    routable = fill(index, rng)
    print(f"index pre-filled: {index.entries:,} entries, {index.nodes:,} nodes, "
          f"{time.perf_counter() - started:.1f} s")
    replicas = [Replica(ReplicaSettings(url=f"http://10.0.0.{i}:8000", name=name))
                for i, name in enumerate(REPLICAS)]
    for replica in replicas:
        replica.in_flight = rng.randrange(8)
        replica.prefill_tokens_queued = rng.randrange(4) * 2048
        replica.decoding = replica.in_flight
    teach_terms(replicas, rng)
    policy = make_policy(policy_name, seed=7)
    tpb = hasher.tokens_per_block
    perf = time.perf_counter_ns

    def route(prompt: str):
        lazy = hasher.lazy(prompt)
        matched = index.match(lazy)
        features = RequestFeatures(
            route="/v1/chat/completions",
            prompt_tokens=hasher.estimate_tokens(prompt),
            cached_tokens={name: int(blocks * tpb) for name, blocks in matched.items()},
            prefix_rate=5.0,  # a sought-after prefix: predictive also prices its copies
            batch_persistence=0.5,  # learned: predictive prices each batch around the mean
        )
        best = policy.rank(features, replicas)[0].replica.name
        return lazy, matched, best

    header = (f"{'prompt':>8} {'case':<26} {'route p50 us':>12} {'p99':>7} {'rounds p50':>13} "
              f"{'hashed':>6} {'record p50 us':>13} {'p99':>7}  floor (on the p50)")
    print(header)
    medians = {}
    for size in SIZES:
        count = max(ROUNDS * 10, int(ROUTES[size] * scale))
        prompts = routable[size]
        for case in ("held (2 hold all)", "new session (system only)"):
            held = case.startswith("held")
            route_us, record_us, hashed, round_medians = [], [], [], []
            for round_ in range(ROUNDS + 1):  # round 0 warms up
                this_round = []
                for i in range(count // ROUNDS):
                    held_prompt, new_prompt = prompts[i % len(prompts)]
                    prompt = held_prompt if held else new_prompt
                    t0 = perf()
                    lazy, matched, best = route(prompt)
                    t1 = perf()
                    computed = lazy.computed
                    if held:
                        best = max(matched, key=matched.__getitem__)  # refresh a full holder
                    index.record(best, lazy)
                    t2 = perf()
                    if not held:
                        # Untimed: undo, so every repeat is a new session again.
                        index.truncate(best, lazy, matched.get(best, 0))
                    if round_:
                        this_round.append((t1 - t0) / 1e3)
                        record_us.append((t2 - t1) / 1e3)
                        hashed.append(computed)
                if round_:
                    route_us += this_round
                    round_medians.append(statistics.median(this_round))
            median = statistics.median(route_us)
            floor = FLOORS_US.get(size)
            verdict = ""
            if floor is not None and held:
                medians[size] = median
                verdict = f"<= {floor:.0f} us: {'PASS' if median <= floor else 'FAIL'}"
            spread = f"{min(round_medians):.0f}-{max(round_medians):.0f}"
            print(f"{size // 1000:>7}k {case:<26} {median:>12.1f} {percentile(route_us, 0.99):>7.0f} "
                  f"{spread:>13} {statistics.median(hashed):>6.0f} "
                  f"{statistics.median(record_us):>13.1f} {percentile(record_us, 0.99):>7.0f}  {verdict}")
    print("hashed: blocks hashed by the route (lazily); of 62 / 500 / 2000 / 8000.\n"
          "record: held = refresh every block; new session = finish hashing, add the blocks.")
    return medians


FLEET_RANK_FLOOR_US = 1000.0


def bench_fleet_rank(policy_name: str, replicas_n: int = 200, calls: int = 2000) -> float:
    """Median microseconds to rank `replicas_n` loaded replicas for one 8k-token prompt."""
    rng = random.Random(11)
    replicas = [Replica(ReplicaSettings(url=f"http://10.1.{i // 250}.{i % 250}:8000", name=f"gpu-{i:03d}"))
                for i in range(replicas_n)]
    for replica in replicas:
        replica.in_flight = replica.decoding = rng.randrange(32)
        replica.prefill_tokens_queued = rng.randrange(8) * 2048
        replica.context_tokens = replica.decoding * 4096
    teach_terms(replicas, rng)
    features = RequestFeatures(
        route="/v1/chat/completions", prompt_tokens=8000,
        cached_tokens={r.name: rng.randrange(8000) for r in rng.sample(replicas, 20)},
        prefix_rate=5.0,
        batch_persistence=0.5,
    )
    policy = make_policy(policy_name, seed=7)
    perf = time.perf_counter_ns
    times = []
    for _ in range(calls):
        t0 = perf()
        policy.rank(features, replicas)
        times.append((perf() - t0) / 1e3)
    median = statistics.median(times[calls // 10:])
    print(f"rank {replicas_n} replicas, 8k-token prompt: p50 {median:.0f} us, p99 "
          f"{percentile(times, 0.99):.0f} us (floor {FLEET_RANK_FLOOR_US:.0f} us): "
          f"{'PASS' if median <= FLEET_RANK_FLOOR_US else 'FAIL'}")
    return median


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def fill_million(shared: bool) -> PrefixIndex:
    """1,000,000 entries over 16 replicas from distinct 2k-token prompts (128 blocks). Either
    each prompt goes to one replica (a node per entry: the worst case) or sessions share a
    512-token system prompt and each prompt is held by two replicas."""
    rng = random.Random(11)
    index = PrefixIndex(tokens_per_block=hasher.tokens_per_block, clock=lambda: 0.0)
    body = synthetic_text(2_000, rng)
    system = synthetic_text(512, rng)
    n = 0
    while index.entries < 1_000_000:
        n += 1
        if shared:
            # The counter goes after the system prompt: every session shares its blocks.
            hashes = hasher.hashes(system + f"{n:064x}" + body[:6_000])
            for name in rng.sample(REPLICAS, 2):
                index.record(name, hashes)
        else:
            index.record(REPLICAS[n % 16], hasher.hashes(f"{n:064x}" + body))
    return index


def rss_delta_of_fill(shared: bool) -> int:
    """RSS growth from filling an index, in this (fresh) process."""
    gc.collect()
    before = rss_bytes()
    index = fill_million(shared)
    gc.collect()
    assert index.entries >= 1_000_000
    return rss_bytes() - before


def bench_memory() -> list[float]:
    print(f"\n{'index of 1M entries':<40} {'entries':>10} {'nodes':>10} {'tracemalloc':>12} "
          f"{'B/entry':>8} {'RSS delta':>10} {'B/entry':>8}")
    per_million = []
    for shared, label in ((False, "distinct prompts, 1 replica each"),
                          (True, "shared system prompt, 2 replicas each")):
        # RSS in a fresh process: here, freed arenas of earlier phases would be reused.
        child = subprocess.run(
            [sys.executable, "-m", "loadtest.bench.routing", "--rss-child", str(int(shared))],
            check=True, capture_output=True, text=True)
        rss = int(child.stdout.split()[-1])
        gc.collect()
        tracemalloc.start()
        index = fill_million(shared)
        gc.collect()
        traced = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        entries, nodes = index.entries, index.nodes
        del index
        gc.collect()
        per_million.append(max(traced, rss) / entries * 1e6)
        print(f"{label:<40} {entries:>10,} {nodes:>10,} {traced / 1e6:>9.1f} MB "
              f"{traced / entries:>8.0f} {rss / 1e6:>7.1f} MB {rss / entries:>8.0f}")
    return per_million


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the route counts")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory part")
    parser.add_argument("--policy", default="predictive", help="the policy that ranks (default %(default)s)")
    parser.add_argument("--rss-child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rss_child is not None:
        print(rss_delta_of_fill(bool(args.rss_child)))
        return 0
    print(f"python -m loadtest.bench.routing {' '.join(argv or sys.argv[1:])}".rstrip())
    print(f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs; block = "
          f"{hasher.block_chars} chars = {hasher.tokens_per_block:g} tokens; scoring is "
          f"the {args.policy} policy over 16 replicas")
    medians = bench_routes(args.scale, args.policy)
    ok = all(medians[size] <= floor for size, floor in FLOORS_US.items())
    ok = bench_fleet_rank(args.policy) <= FLEET_RANK_FLOOR_US and ok
    if not args.no_memory:
        per_million = bench_memory()
        worst = max(per_million)
        fits = worst <= FLOOR_BYTES_PER_MILLION
        print(f"1,000,000 entries, worst of tracemalloc and RSS: {worst / 1e6:.0f} MB "
              f"(floor {FLOOR_BYTES_PER_MILLION / 1e6:.0f} MB): {'PASS' if fits else 'FAIL'}")
        ok = ok and fits
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

