"""kvlb's CPU per request under several configurations, in one run: the A/B the flow-control
and tracing benchmarks share.

The kvlb processes stand in front of the same instant upstream (`loadtest.bench.proxy`'s)
and take turns on the same requests, each process in each position of a round as often,
since a process's position in a round changes what it finds of the machine, and that must
not read as a cost. What is compared is the median over rounds of each process's CPU time
(from /proc) per request. One process can also run several per cent dearer than another of
the same configuration for as long as it lives: where a few per cent matter, run two of
each and compare their means (`loadtest.bench.flow`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from loadtest.bench.proxy import measure
from loadtest.procs import free_port, read_cpu_seconds, start_process, stop_process, wait_for_http

BODY = (b'{"model": "bench", "messages": [{"role": "user", "content": "Say hello."}], '
        b'"max_tokens": 8, "temperature": 0}')


def base_config(port: int, upstream: int) -> dict[str, Any]:
    return {"listen": {"host": "127.0.0.1", "port": port},
            "replicas": [{"url": f"http://127.0.0.1:{upstream}", "model": "bench"}],
            "policy": {"name": "least_load"}}


async def cpu_per_request(configs: Mapping[str, Callable[[dict[str, Any]], None]], args: argparse.Namespace,
                          headers: Mapping[str, str] | None = None) -> dict[str, list[float]]:
    """Per configuration (each a change to the base config), kvlb's CPU seconds per request of
    each round."""
    upstream_port = free_port()
    env = dict(os.environ)
    procs = []
    with tempfile.TemporaryDirectory(prefix="kvlb-bench-ab-") as tmp:
        procs.append(start_process([sys.executable, "-m", "loadtest.bench.proxy", "--upstream-only",
                                    str(upstream_port)], env))
        targets = {}
        try:
            for name, change in configs.items():
                port = free_port()
                data = base_config(port, upstream_port)
                change(data)
                path = Path(tmp) / f"{name}.yaml"
                path.write_text(yaml.safe_dump(data))
                proc = start_process([sys.executable, "-m", "balancer", "serve", "--config", str(path)], env)
                procs.append(proc)
                targets[name] = (proc, f"http://127.0.0.1:{port}")
            await wait_for_http(f"http://127.0.0.1:{upstream_port}/v1/models")
            for _, url in targets.values():
                await wait_for_http(url + "/ready")
            per_request: dict[str, list[float]] = {name: [] for name in targets}
            names = list(targets)
            # Each process takes each position in a round as often (every rotation, forwards
            # and backwards): with three, reversing alone would keep the middle one there.
            orders = [names[i:] + names[:i] for i in range(len(names))]
            orders += [order[::-1] for order in orders]
            for round_ in range(args.rounds):
                for name in orders[round_ % len(orders)]:
                    proc, url = targets[name]
                    before = read_cpu_seconds(proc.pid)
                    await measure(url + "/v1/chat/completions", args.concurrency, args.requests, BODY, dict(headers or {}))
                    per_request[name].append((read_cpu_seconds(proc.pid) - before) / (args.requests + 2 * args.concurrency))
            return per_request
        finally:
            for proc in procs:
                stop_process(proc)


def report(title: str, per_request: Mapping[str, list[float]], base: str, other: str, floor: str) -> None:
    first, second = statistics.median(per_request[base]), statistics.median(per_request[other])
    ratios = paired(per_request, base, other)
    print(title)
    print(f"  {base}: {first * 1e6:6.0f} µs")
    print(f"  {other}: {second * 1e6:6.0f} µs   ({second / first:.2f}x; {floor})")
    print(f"  {other}/{base} of each round: median {statistics.median(ratios):.2f}; "
          f"{' '.join(f'{r:.2f}' for r in ratios)} (sorted)")


def paired(per_request: Mapping[str, list[float]], base: str, other: str) -> list[float]:
    return sorted(b / a for a, b in zip(per_request[base], per_request[other], strict=True))


def arguments(doc: str | None, rounds: int = 6) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=rounds)
    return parser.parse_args()
