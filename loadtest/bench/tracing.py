"""What tracing costs: kvlb's CPU per request with `tracing.otlp_endpoint` set against unset, in
one run, in front of an instant upstream (`loadtest.bench.ab`). The spans go to a receiver
in this process that takes them and answers at once (nothing is decoded). Tracing off is the
code path of every request: the A/B of the code with tracing and without it is in
docs/operations.md (Traces).

    python -m loadtest.bench.tracing [--requests 3000] [--concurrency 16] [--rounds 6]
"""

from __future__ import annotations

import os

from aiohttp import web

from loadtest.bench.ab import arguments, cpu_per_request, report
from loadtest.procs import free_port


async def bench() -> None:
    args = arguments(__doc__)

    async def take(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", take)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    endpoint = f"http://127.0.0.1:{port}/v1/traces"
    try:
        per_request = await cpu_per_request(
            {"tracing off": lambda config: None,
             "tracing on": lambda config: config.update(tracing={"otlp_endpoint": endpoint})}, args,
            {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})
    finally:
        await runner.cleanup()
    report(f"kvlb CPU per request, {args.requests} requests x {args.rounds} rounds at concurrency "
           f"{args.concurrency}, {os.cpu_count()} CPUs (median of rounds)",
           per_request, "tracing off", "tracing on", "the spans' own cost; off costs nothing measurable")


def main() -> None:
    import uvloop

    uvloop.run(bench())


if __name__ == "__main__":
    main()
