"""Flow control's cost below saturation: kvlb's CPU per request with `flow_control` on against
off, in one run, in front of an instant upstream (`loadtest.bench.proxy`'s).

Two kvlb processes, the same but for flow control (the issue's minimal configuration, with
trusted headers), take turns on the same requests, each carrying a tenant and a class; the
ratio of their CPU time per request is the cost flow control adds when nothing waits.

    python -m loadtest.bench.flow [--requests 3000] [--concurrency 16] [--rounds 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

from loadtest.bench.proxy import measure
from loadtest.procs import free_port, read_cpu_seconds, start_process, stop_process, wait_for_http

BODY = (b'{"model": "bench", "messages": [{"role": "user", "content": "Say hello."}], '
        b'"max_tokens": 8, "temperature": 0}')
FLOW = {"enabled": True, "trust_headers": True, "default_class": "standard",
        "classes": [{"name": "critical", "ttft_slo_ms": 2000}, {"name": "standard"},
                    {"name": "batch", "sheddable": True}]}


def config(port: int, upstream: int, flow: bool) -> dict:
    data: dict = {"listen": {"host": "127.0.0.1", "port": port},
                  "replicas": [{"url": f"http://127.0.0.1:{upstream}", "model": "bench"}],
                  "policy": {"name": "least_load"}}
    if flow:
        data["flow_control"] = FLOW
    return data


async def bench(args: argparse.Namespace) -> None:
    upstream_port = free_port()
    env = dict(os.environ)
    procs = []
    with tempfile.TemporaryDirectory(prefix="kvlb-bench-flow-") as tmp:
        upstream = start_process([sys.executable, "-m", "loadtest.bench.proxy", "--upstream-only",
                                  str(upstream_port)], env)
        procs.append(upstream)
        targets = {}
        try:
            for name, flow in (("off", False), ("on", True)):
                port = free_port()
                path = Path(tmp) / f"{name}.yaml"
                path.write_text(yaml.safe_dump(config(port, upstream_port, flow)))
                proc = start_process([sys.executable, "-m", "balancer", "serve", "--config", str(path)], env)
                procs.append(proc)
                targets[name] = (proc, f"http://127.0.0.1:{port}")
            await wait_for_http(f"http://127.0.0.1:{upstream_port}/v1/models")
            for _, url in targets.values():
                await wait_for_http(url + "/ready")
            headers = {"x-kvlb-tenant": "acme", "x-kvlb-priority": "critical"}
            per_request: dict[str, list[float]] = {"off": [], "on": []}
            names = list(targets)
            for round_ in range(args.rounds):
                # Each round reverses the order of the last: whichever runs second in a round
                # can find the machine in another state, and that must not read as a cost.
                for name in names if round_ % 2 == 0 else names[::-1]:
                    proc, url = targets[name]
                    before = read_cpu_seconds(proc.pid)
                    await measure(url + "/v1/chat/completions", args.concurrency, args.requests, BODY, headers)
                    spent = read_cpu_seconds(proc.pid) - before
                    per_request[name].append(spent / (args.requests + 2 * args.concurrency))
            off, on = statistics.median(per_request["off"]), statistics.median(per_request["on"])
            ratios = sorted(b / a for a, b in zip(per_request["off"], per_request["on"], strict=True))
            print(f"kvlb CPU per request below saturation, {args.requests} requests x {args.rounds} rounds at "
                  f"concurrency {args.concurrency}, {os.cpu_count()} CPUs (median of rounds)")
            print(f"  flow control off: {off * 1e6:6.0f} µs")
            print(f"  flow control on:  {on * 1e6:6.0f} µs   ({on / off:.2f}x; floor: within 1.10x)")
            print(f"  on/off of each round: {' '.join(f'{r:.2f}' for r in ratios)} (sorted)")
        finally:
            for proc in procs:
                stop_process(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=6)
    import uvloop

    uvloop.run(bench(parser.parse_args()))


if __name__ == "__main__":
    main()
