"""Flow control's cost below saturation: kvlb's CPU per request with `flow_control` on against
off, in one run, in front of an instant upstream (`loadtest.bench.ab`).

The issue's minimal configuration, with trusted headers; every request carries a tenant and
a class.

    python -m loadtest.bench.flow [--requests 3000] [--concurrency 16] [--rounds 6]
"""

from __future__ import annotations

import os

from loadtest.bench.ab import arguments, cpu_per_request, report

FLOW = {"enabled": True, "trust_headers": True, "default_class": "standard",
        "classes": [{"name": "critical", "ttft_slo_ms": 2000}, {"name": "standard"},
                    {"name": "batch", "sheddable": True}]}


def main() -> None:
    import uvloop

    args = arguments(__doc__)
    per_request = uvloop.run(cpu_per_request(
        {"flow control off": lambda config: None, "flow control on": lambda config: config.update(flow_control=FLOW)},
        args, {"x-kvlb-tenant": "acme", "x-kvlb-priority": "critical"}))
    report(f"kvlb CPU per request below saturation, {args.requests} requests x {args.rounds} rounds at "
           f"concurrency {args.concurrency}, {os.cpu_count()} CPUs (median of rounds)",
           per_request, "flow control off", "flow control on", "floor: within 1.10x")


if __name__ == "__main__":
    main()
