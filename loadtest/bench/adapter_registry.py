"""Adapters loaded on demand onto replicas that keep only so many registered (SGLang's
`--max-loaded-loras`), live: kvlb in front of simulated replicas that start with no adapter,
`adapters.load_on_demand` naming every adapter of a Zipf-popular LoRA workload.

Three runs on fresh replicas: with no registration limit (every load succeeds, nothing need
be unloaded), with the limit and kvlb unloading to make room (the default), and with the limit
and `unload_to_make_room: false` (what kvlb did before it unloaded: once a replica is full,
each new adapter's requests fail). Printed per run: errors, TTFT p50/p99 (model time), cache
hit, the loads and unloads kvlb asked for, and the most adapters any replica listed at the end.
Each load request reads the adapter for `--register-ms` of model time before it is registered
(the engines read it from disk at every load), so unloading and loading again is not free.

    python -m loadtest.bench.adapter_registry [--replicas 4] [--limit 8] [--requests 600]
                                              [--rate 10] [--time-scale 4] [--register-ms 200]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import aiohttp

from loadtest.client.runner import run_load
from loadtest.client.summary import summarize
from loadtest.client.workloads import load_workload
from loadtest.compare.livefleet import LiveFleet

ADAPTERS = 32
LOAD_MS = 500
SLOTS = 4


def _counter(metrics: str, family: str) -> float:
    return sum(float(line.rpartition(" ")[2]) for line in metrics.splitlines()
               if line.startswith(family + "{") and 'outcome="failed"' not in line)


async def run(args: argparse.Namespace, limit: int | None, unload: bool) -> dict[str, Any]:
    spec = (f"lora,adapters={ADAPTERS},zipf=1.0,system_tokens=1000,question_tokens=64,output_tokens=32,"
            f"requests={args.requests},rate={args.rate:g}")
    workload = load_workload(spec)
    replica_args = ["--enable-lora", "--allow-runtime-lora-updating", "--max-loras", str(SLOTS),
                    "--lora-load-ms", str(LOAD_MS), "--lora-register-ms", f"{args.register_ms:g}"]
    if limit is not None:
        replica_args += ["--max-loaded-loras", str(limit)]
    async with LiveFleet(args.replicas, time_scale=args.time_scale, replica_args=replica_args,
                         replica_settings={"lora_load_ms": LOAD_MS}) as fleet:
        await fleet.start_replicas()
        names = sorted({r.adapter for r in workload.requests if r.adapter is not None})
        adapters = {"load_on_demand": [{"name": n, "path": f"/adapters/{n}", "base": fleet.model} for n in names],
                    "load_path": "/load_lora_adapter", "unload_to_make_room": unload}
        target = await fleet.start_kvlb("predictive", seed=0, extra={"adapters": adapters})
        try:
            records, meta = await run_load(target, workload.requests, model=fleet.model,
                                           time_scale=args.time_scale, timeout_s=120.0, progress=False)
            async with aiohttp.ClientSession() as http:
                async with http.get(target + "/metrics") as resp:
                    metrics = await resp.text()
                listed = 0
                for url in fleet.replica_urls:
                    async with http.get(url + "/v1/models") as resp:
                        cards = (await resp.json())["data"]
                    listed = max(listed, sum(1 for card in cards if card.get("parent")))
        finally:
            fleet.stop_router()
        summary = summarize(records, meta.pop("duration_s"), replicas=fleet.replica_names, meta=meta)
        summary["loads"] = _counter(metrics, "kvlb_adapter_loads_total")
        summary["unloads"] = _counter(metrics, "kvlb_adapter_unloads_total")
        summary["most_listed"] = listed
        return summary


async def main_async(args: argparse.Namespace) -> int:
    print(f"{args.replicas} replicas, {SLOTS} adapter slots each, {LOAD_MS} ms slot loads, {args.register_ms:g} ms "
          f"to read an adapter at each load, {ADAPTERS} adapters (Zipf 1.0) loaded on demand; {args.requests} requests at {args.rate:g}/s, time scale {args.time_scale:g}\n")
    print("| registration limit | unload to make room | errors | TTFT p50 | TTFT p99 | cache hit | loads | unloads "
          "| most adapters a replica listed |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for limit, unload in ((None, True), (args.limit, True), (args.limit, False)):
        s = await run(args, limit, unload)
        ttft = s["ttft_s"]
        p50 = "-" if ttft["p50"] is None else f"{ttft['p50'] * 1000:,.0f} ms"
        p99 = "-" if ttft["p99"] is None else f"{ttft['p99'] * 1000:,.0f} ms"
        print(f"| {limit or 'none'} | {'yes' if unload else 'no'} | {s['errors']} | {p50} | {p99} "
              f"| {s['cache_hit_ratio']:.3f} | {s['loads']:.0f} | {s['unloads']:.0f} | {s['most_listed']} |", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--limit", type=int, default=8, help="adapters each replica keeps registered")
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--rate", type=float, default=10.0, help="requests per second of model time")
    parser.add_argument("--time-scale", type=float, default=4.0)
    parser.add_argument("--register-ms", type=float, default=200.0,
                        help="model ms a load request takes to read the adapter before it is registered")
    return asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
