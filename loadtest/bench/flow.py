"""Flow control's cost below saturation: kvlb's CPU per request with `flow_control` on against
off, in one run, in front of an instant upstream (`loadtest.bench.ab`).

The issue's minimal configuration, with trusted headers; every request carries a tenant and
a class. A second process with flow control off runs beside them as the control: two
identical processes differ by several per cent on a shared machine, so flow control's
figure means something only beside that one.

    python -m loadtest.bench.flow [--requests 3000] [--concurrency 16] [--rounds 12]
"""

from __future__ import annotations

import os

from loadtest.bench.ab import arguments, cpu_per_request, report

FLOW = {"enabled": True, "trust_headers": True, "default_class": "standard",
        "classes": [{"name": "critical", "ttft_slo_ms": 2000}, {"name": "standard"},
                    {"name": "batch", "sheddable": True}]}


def main() -> None:
    import uvloop

    args = arguments(__doc__, rounds=12)
    off = "flow control off"
    per_request = uvloop.run(cpu_per_request(
        {off: lambda config: None, "flow control on": lambda config: config.update(flow_control=FLOW),
         "control, off again": lambda config: None},
        args, {"x-kvlb-tenant": "acme", "x-kvlb-priority": "critical"}))
    report(f"kvlb CPU per request below saturation, {args.requests} requests x {args.rounds} rounds at "
           f"concurrency {args.concurrency}, {os.cpu_count()} CPUs (median of rounds)",
           per_request, off, "flow control on", "floor: within 1.10x", control="control, off again")


if __name__ == "__main__":
    main()
