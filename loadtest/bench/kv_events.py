"""What applying engines' KV events costs kvlb in precise mode, by prompt length.

    python -m loadtest.bench.kv_events

Each replica's engine is played as vLLM reports it: a request's prefill stores its new blocks
in one `BlockStored`, then every `block_size` generated tokens store one more block (one event
each), and blocks are evicted leaf first once the engine is full. Prints events and blocks
applied per second of CPU spent applying them (the engine's own play is not counted), for prompts of 64 to 2,048 blocks (16-token blocks:
1k to 32k tokens), and a prediction's cost against the same index.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict

from balancer.config import KvEventsSettings, RoutingSettings
from balancer.routing.kv_events import Removed, Stored
from balancer.routing.precise import PreciseTracker

BLOCK = 16
REPLICAS = 8
CAPACITY_BLOCKS = 20_000  # per replica: 320k tokens
DECODE_BLOCKS = 8  # 128 generated tokens a request


def run(prompt_blocks: int, requests: int, seed: int = 1) -> dict[str, float]:
    rng = random.Random(seed)
    tracker = PreciseTracker(RoutingSettings(), KvEventsSettings(enabled=True, block_size=BLOCK), time.monotonic)
    events = tracker.events
    next_hash = iter(range(1, 1 << 62))
    # Per replica: engine hash -> parent engine hash, in LRU order (oldest first), and the
    # chains of earlier prompts, which later ones share a prefix of (a conversation, a document).
    cached: list[OrderedDict[int, int | None]] = [OrderedDict() for _ in range(REPLICAS)]
    children: list[dict[int | None, int]] = [{} for _ in range(REPLICAS)]
    chains: list[list[list[int]]] = [[] for _ in range(REPLICAS)]
    batches, blocks_applied, predict_s, predictions, apply_s = 0, 0, 0.0, 0, 0.0
    for _ in range(requests):
        r = rng.randrange(REPLICAS)
        name = f"r{r}"
        shared: list[int] = []
        if chains[r] and rng.random() < 0.7:
            base = rng.choice(chains[r])
            shared = [h for h in base[: rng.randrange(len(base) // 2, len(base) + 1)] if h in cached[r]]
        tokens = [rng.randrange(50_000) for _ in range((prompt_blocks + DECODE_BLOCKS) * BLOCK)]
        chain = list(shared)
        stored_batches: list[list] = []
        new = prompt_blocks - len(shared)
        if new > 0:
            hashes = [next(next_hash) for _ in range(new)]
            start = len(shared) * BLOCK
            stored_batches.append([Stored(hashes, shared[-1] if shared else None,
                                          tokens[start:start + new * BLOCK], BLOCK, None, "GPU")])
            chain += hashes
        for _ in range(DECODE_BLOCKS):
            h = next(next_hash)
            start = len(chain) * BLOCK
            stored_batches.append([Stored([h], chain[-1] if chain else None, tokens[start:start + BLOCK], BLOCK, None, "GPU")])
            chain.append(h)
        chains[r].append(chain)
        if len(chains[r]) > 50:
            chains[r].pop(0)
        t0 = time.process_time()
        tracker.predict(tokens[: prompt_blocks * BLOCK])
        predict_s += time.process_time() - t0
        predictions += 1
        for batch in stored_batches:
            for event in batch:
                parent = event.parent_block_hash
                for h in event.block_hashes:
                    cached[r][h] = parent
                    children[r][parent] = children[r].get(parent, 0) + 1
                    parent = h
            # The engine makes room, leaf first, before the next step stores more.
            evicted = []
            while len(cached[r]) > CAPACITY_BLOCKS:
                for h in cached[r]:
                    if not children[r].get(h):
                        break
                p = cached[r].pop(h)
                children[r][p] -= 1
                evicted.append(h)
            if evicted:
                batch = [*batch, Removed(evicted, "GPU")]
            t0 = time.process_time()
            events.apply(name, batch)
            apply_s += time.process_time() - t0
            batches += 1
            blocks_applied += sum(len(e.block_hashes) for e in batch)
    spent = apply_s
    return {
        "batches_per_s": batches / spent,
        "blocks_per_s": blocks_applied / spent,
        "us_per_batch": spent / batches * 1e6,
        "us_per_prediction": predict_s / predictions * 1e6,
    }


def main() -> None:
    print(f"{REPLICAS} replicas, {CAPACITY_BLOCKS:,} blocks of {BLOCK} tokens each, {DECODE_BLOCKS} decode blocks a request")
    print(f"{'prompt blocks':>13} {'batches/s':>10} {'blocks/s':>10} {'us/batch':>9} {'us/predict':>10}")
    for prompt_blocks, requests in ((64, 3000), (512, 1000), (2048, 300)):
        row = run(prompt_blocks, requests)
        print(f"{prompt_blocks:>13} {row['batches_per_s']:>10,.0f} {row['blocks_per_s']:>10,.0f} "
              f"{row['us_per_batch']:>9.1f} {row['us_per_prediction']:>10.1f}")


if __name__ == "__main__":
    main()
