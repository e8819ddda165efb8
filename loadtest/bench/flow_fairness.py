"""How closely two kvlb instances sharing Redis hold one fair share between tenants: tenant
`wide` floods the fleet through both instances, tenant `narrow` through the first only, both
far past what the fleet serves. One fair share gives each half the fleet; enforced on each
instance's own state, the second instance gives everything to `wide` and `narrow` gets about
a quarter. The figure is `narrow`'s share of what was served, with the share exchanged
through Redis and without (each instance on its own).

Needs Redis on 127.0.0.1:6379 (or `--redis`).

    python -m loadtest.bench.flow_fairness [--rate 200] [--seconds 6]
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
from collections import Counter

import aiohttp
import uvloop

from balancer import start_balancer
from balancer.config import parse_settings
from loadtest.bench.flow_share import FLOW, fleet_arguments, upstream
from loadtest.procs import free_port


async def served_shares(args: argparse.Namespace, shared: bool) -> Counter[str]:
    port = free_port()
    runner = await upstream(port, args.hold_s)
    data = {"listen": {"host": "127.0.0.1"}, "health": {"interval_s": 3600},
            "replicas": [{"url": f"http://127.0.0.1:{port}", "name": "only", "model": "m", "max_concurrency": 2}],
            "flow_control": FLOW, "limits": {"queue_timeout_s": 30, "max_queued": 10000}}
    if shared:
        data["sync"] = {"redis_url": args.redis, "key_prefix": f"kvlb-bench-{secrets.token_hex(4)}",
                        "load_interval_s": args.interval_s, "load_ttl_s": 1.0}
    instances = [await start_balancer(parse_settings(data), port=free_port()) for _ in range(2)]
    served: Counter[str] = Counter()
    try:
        flows = [i.balancer.core.flow for i in instances]
        while shared and not all(f.remote_peers == 1 for f in flows):
            await asyncio.sleep(0.05)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            loop = asyncio.get_running_loop()
            warm_until = loop.time() + args.warmup_s

            async def one(tenant: str, instance: int) -> None:
                url = f"http://127.0.0.1:{instances[instance].port}/v1/completions"
                body = {"model": "m", "prompt": "the same prompt for both tenants", "max_tokens": 1}
                async with http.post(url, json=body, headers={"x-kvlb-tenant": tenant}) as resp:
                    await resp.read()
                    if resp.status == 200 and loop.time() > warm_until:
                        served[tenant] += 1

            tasks = []
            end = loop.time() + args.seconds
            n = 0
            while loop.time() < end:
                # wide: through both instances in turn; narrow: through the first only.
                tasks.append(asyncio.create_task(one("wide", n % 2)))
                tasks.append(asyncio.create_task(one("narrow", 0)))
                n += 1
                await asyncio.sleep(1 / args.rate)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for instance in instances:
            await instance.close(grace_s=0.5)
        await runner.cleanup()
    return served


async def bench(args: argparse.Namespace) -> None:
    print(f"two instances, one replica taking 2 at a time ({args.hold_s * 1000:g} ms each); tenants wide (both "
          f"instances) and narrow (the first) at {args.rate:g} requests/s each for {args.seconds:g} s, "
          f"counted after {args.warmup_s:g} s")
    for shared in (False, True):
        served = await served_shares(args, shared)
        total = sum(served.values()) or 1
        share = served["narrow"] / total
        how = (f"shared through Redis (every {args.interval_s * 1000:g} ms)" if shared
               else "each instance on its own")
        # Each instance on its own admits up to the cap on each: the fleet's capacity twice over.
        capacity = 2 / args.hold_s * (args.seconds - args.warmup_s) * (1 if shared else 2)
        print(f"  {how}: narrow served {served['narrow']}, wide {served['wide']}: narrow's share {share:.2f} "
              f"(one fair share: 0.50; error {abs(share - 0.5):.2f}); {total / capacity:.0%} of the places used")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=200.0, help="requests a second per tenant")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--warmup-s", type=float, default=1.0)
    uvloop.run(bench(fleet_arguments(parser).parse_args()))


if __name__ == "__main__":
    main()
