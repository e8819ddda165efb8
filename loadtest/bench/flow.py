"""Flow control's cost below saturation: kvlb's CPU per request with `flow_control` on against
off, in one run, in front of an instant upstream (`loadtest.bench.ab`).

The issue's minimal configuration, with trusted headers; every request carries a tenant and
a class. Two processes of each configuration take turns, started off, on, on, off: on this
machine one process can run several per cent dearer than another of the same configuration
for as long as it lives (where the scheduler puts it beside the upstream and the load), so a
figure from one process of each can read as a cost what is a difference between processes.
Each configuration's figure is the mean of its two processes; the pair of processes of one
configuration shows what the machine alone makes of two identical ones.

    python -m loadtest.bench.flow [--requests 3000] [--concurrency 16] [--rounds 16]
"""

from __future__ import annotations

import os
import statistics

from loadtest.bench.ab import arguments, cpu_per_request, paired, report

FLOW = {"enabled": True, "trust_headers": True, "default_class": "standard",
        "classes": [{"name": "critical", "ttft_slo_ms": 2000}, {"name": "standard"},
                    {"name": "batch", "sheddable": True}]}


OFF, ON = "flow control off", "flow control on"


def main() -> None:
    import uvloop

    args = arguments(__doc__, rounds=16)
    off = lambda config: None  # noqa: E731
    on = lambda config: config.update(flow_control=FLOW)  # noqa: E731
    per_process = uvloop.run(cpu_per_request(
        {OFF + " (1)": off, ON + " (1)": on, ON + " (2)": on, OFF + " (2)": off},
        args, {"x-kvlb-tenant": "acme", "x-kvlb-priority": "critical"}))
    per_request = {name: [(a + b) / 2 for a, b in zip(per_process[name + " (1)"], per_process[name + " (2)"],
                                                      strict=True)] for name in (OFF, ON)}
    report(f"kvlb CPU per request below saturation, {args.requests} requests x {args.rounds} rounds at "
           f"concurrency {args.concurrency}, {os.cpu_count()} CPUs, two processes each (median of rounds)",
           per_request, OFF, ON, "floor: within 1.10x")
    same = statistics.median(paired(per_process, OFF + " (1)", OFF + " (2)"))
    print(f"  two processes both off, one against the other: median {same:.2f} (what the machine alone makes)")


if __name__ == "__main__":
    main()
