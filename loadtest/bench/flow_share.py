"""How closely two kvlb instances sharing Redis hold one per-tenant bound: a tenant allowed
`--bound` waiting requests sends bursts through both at once while the fleet is saturated;
the figure is how far its waiting requests, on both instances together, went past the bound.

Needs Redis on 127.0.0.1:6379 (or `--redis`).

    python -m loadtest.bench.flow_share [--bound 20] [--rate 400] [--seconds 5]
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
from loadtest.procs import free_port

FLOW = {"enabled": True, "trust_headers": True, "default_class": "standard", "classes": [{"name": "standard"}]}


async def upstream(port: int, hold_s: float) -> asyncio.AbstractServer:
    """A replica that answers after `hold_s`: with kvlb's cap of 1, the fleet stays saturated."""
    from aiohttp import web

    async def complete(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(hold_s)
        return web.json_response({"choices": [{"index": 0, "text": "ok"}], "usage": {"prompt_tokens": 1,
                                  "completion_tokens": 1, "total_tokens": 2}})

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    return runner


async def bench(args: argparse.Namespace) -> None:
    port = free_port()
    runner = await upstream(port, args.hold_s)
    sync = {"redis_url": args.redis, "key_prefix": f"kvlb-bench-{secrets.token_hex(4)}",
            "load_interval_s": args.interval_s, "load_ttl_s": 1.0}
    data = {"listen": {"host": "127.0.0.1"}, "health": {"interval_s": 3600},
            "replicas": [{"url": f"http://127.0.0.1:{port}", "name": "only", "model": "m", "max_concurrency": 1}],
            "flow_control": {**FLOW, "max_queued_per_tenant": args.bound}, "sync": sync,
            "limits": {"queue_timeout_s": 30}}
    instances = [await start_balancer(parse_settings(data), port=free_port()) for _ in range(2)]
    try:
        flows = [i.balancer.core.flow for i in instances]
        while not all(f.remote_peers == 1 for f in flows):
            await asyncio.sleep(0.05)
        statuses: Counter[int] = Counter()
        peak = 0
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

            async def one(n: int) -> None:
                url = f"http://127.0.0.1:{instances[n % 2].port}/v1/completions"
                body = {"model": "m", "prompt": "x", "max_tokens": 1}
                async with http.post(url, json=body, headers={"x-kvlb-tenant": "noisy"}) as resp:
                    await resp.read()
                    statuses[resp.status] += 1

            tasks = []
            loop = asyncio.get_running_loop()
            end = loop.time() + args.seconds
            n = 0
            while loop.time() < end:
                tasks.append(asyncio.create_task(one(n)))
                n += 1
                peak = max(peak, sum(f.queued for f in flows))
                await asyncio.sleep(1 / args.rate)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        print(f"two instances, tenant bound {args.bound} waiting requests, {n} requests at {args.rate:g}/s over "
              f"{args.seconds:g} s, load exchange every {args.interval_s * 1000:g} ms")
        print(f"  most waiting at once, both instances together: {peak} ({(peak - args.bound) / args.bound:+.0%} "
              f"against the bound; one instance alone would allow {2 * args.bound})")
        print(f"  answers: {dict(statuses)}")
    finally:
        for instance in instances:
            await instance.close(grace_s=0.5)
        await runner.cleanup()


def fleet_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The replica's time per request and the instances' exchange, for the benches of sharing."""
    parser.add_argument("--hold-s", type=float, default=0.05, help="the replica's time per request")
    parser.add_argument("--interval-s", type=float, default=0.1, help="sync.load_interval_s")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    return parser


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bound", type=int, default=20)
    parser.add_argument("--rate", type=float, default=400.0)
    parser.add_argument("--seconds", type=float, default=5.0)
    uvloop.run(bench(fleet_arguments(parser).parse_args()))


if __name__ == "__main__":
    main()
