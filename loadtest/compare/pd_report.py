"""Prefill/decode disaggregation against colocated serving, offline, on the same requests.

    python -m loadtest.compare.pd_report --out docs/compare/disaggregation [--seeds 0,1,2]
        [--long-rates 3,5,7] [--splits 4+4:sglang,5+3:sglang,6+2:sglang,4+4:vllm]

Eight llama-3.1-8b-h100 replicas, one 8-GPU host, either all colocated (each prefills and
decodes) or split into a prefill pool and a decode pool (one `host` label, so a transfer
crosses the host's links: `same_host_gbps`, 400 by default), with the
default `predictive` policy over the prefill pool and kvlb's decode choice
(balancer/routing/disaggregation.py). Two workloads:

- long prompts, the case for splitting: unique prompts of 8,000-32,000 tokens with answers of
  200-500, at loads where the colocated fleet is busy. Every prefill chunk there stalls every
  sequence decoding beside it, which a decode pool never sees. Three splits in SGLang's
  protocol, and 4 + 4 in vLLM's, where a request the saturated prefill pool would hold back
  runs whole on a decode replica;
- short, mostly cached prompts (one 8,000-token system prompt, 200-token questions), where a
  transfer costs more than the prefill it saves: the per-request choice should run them whole
  (vLLM's protocol lets any replica do so).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from balancer.config import DisaggregationSettings, PolicySettings
from loadtest.client.summary import summarize
from loadtest.client.workloads import load_workload
from loadtest.simulator.fleetspec import FleetPlan, parse_fleet, uniform_fleet
from loadtest.simulator.simulator import simulate

REPLICAS = 8
LONG = "long-prompt,requests=600,min_prompt_tokens=8000,max_prompt_tokens=32000,min_output_tokens=200,max_output_tokens=500"
LONG_RATES = (3.0, 5.0, 7.0)
SHORT = "shared-prefix,groups=1,prompts_per_group=3000,system_tokens=8000,question_tokens=200,output_tokens=150"
SHORT_RATES = (12.0, 40.0)
# SGLang's protocol: every request split. vLLM's: one the prefill pool would hold back
# (saturated_ratio) runs whole on a decode replica.
SPLITS = ((4, 4, "sglang"), (5, 3, "sglang"), (6, 2, "sglang"), (4, 4, "vllm"))


def split_fleet(prefill: int, decode: int) -> FleetPlan:
    groups = [{"count": prefill, "role": "prefill", "host": "node-0"},
              {"count": decode, "role": "decode", "host": "node-0"}]
    return parse_fleet({"groups": groups}, "split")


def run(spec: str, fleet: FleetPlan, seed: int, protocol: str = "sglang") -> dict[str, Any]:
    workload = load_workload(f"{spec},seed={seed}")
    result = simulate(fleet, workload.requests, PolicySettings("predictive", {}, seed),
                      disaggregation=DisaggregationSettings(protocol=protocol))
    summary = summarize(result.records, result.duration_s, replicas=result.replicas)
    return summary


def _split(text: str) -> tuple[int, int, str]:
    pools, _, protocol = text.partition(":")
    prefill, plus, decode = pools.partition("+")
    if not plus or protocol not in ("sglang", "vllm") or not (prefill.isdigit() and decode.isdigit()):
        raise ValueError(f"a split is PREFILL+DECODE:sglang|vllm, got {text!r}")
    if int(prefill) < 1 or int(decode) < 1:
        raise ValueError(f"each pool needs a replica, got {text!r}")
    return int(prefill), int(decode), protocol


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.0f}"


def _row(label: str, s: dict[str, Any]) -> str:
    return (f"| {label} | {s['errors']} | {s['cache_hit_ratio']:.3f} | {_ms(s['ttft_s']['p50'])} | "
            f"{_ms(s['ttft_s']['p99'])} | {_ms(s['tpot_s']['p50'])} | {_ms(s['tpot_s']['p99'])} | "
            f"{_ms(s['e2e_s']['p50'])} | {_ms(s['e2e_s']['p99'])} |")


HEADER = ("| fleet | errors | cache hit | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | E2E p50 | E2E p99 "
          "| against colocated |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="directory for report.md")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--long-rates", default=",".join(f"{r:g}" for r in LONG_RATES),
                        help="requests/s of the long-prompt workload")
    parser.add_argument("--splits", default=",".join(f"{p}+{d}:{proto}" for p, d, proto in SPLITS),
                        help="split fleets, each PREFILL+DECODE:PROTOCOL (sglang or vllm)")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    try:
        long_rates = [float(r) for r in args.long_rates.split(",")]
        splits = [_split(text) for text in args.splits.split(",")]
    except ValueError as e:
        parser.error(str(e))
    lines = ["# Prefill/decode disaggregation against colocated serving", "",
             f"Offline, {REPLICAS} x llama-3.1-8b-h100, policy `predictive`, seeds {args.seeds}. Times in ms "
             "of model time. Reproduce: `python -m loadtest.compare.pd_report --out DIR"
             + "".join(f" --{name.replace('_', '-')} {getattr(args, name)}" for name in ("seeds", "long_rates", "splits")
                       if getattr(args, name) != parser.get_default(name)) + "`", ""]
    for seed in seeds:
        lines += [f"## Long prompts, seed {seed}", "", f"`{LONG}` at each rate.", ""]
        for rate in long_rates:
            spec = f"{LONG},rate={rate:g}"
            lines += [f"### {rate:g} requests/s", "", HEADER]
            colocated = run(spec, uniform_fleet(REPLICAS), seed)
            lines.append(_row(f"{REPLICAS} colocated", colocated) + " |")
            for prefill, decode, protocol in splits:
                split = run(spec, split_fleet(prefill, decode), seed, protocol)
                label = f"{prefill} prefill + {decode} decode" + (", vLLM's protocol" if protocol == "vllm" else "")
                lines.append(_row(label, split))
                ratio = colocated["tpot_s"]["p99"] / split["tpot_s"]["p99"]
                ttft = split["ttft_s"]["p99"] / colocated["ttft_s"]["p99"]
                lines[-1] += f" TPOT p99 {ratio:.1f}x lower, TTFT p99 {ttft:.2f}x |"
            lines.append("")
            print(f"seed {seed}, long prompts at {rate:g}/s done", file=sys.stderr, flush=True)
        lines += [f"## Short, mostly cached prompts, seed {seed}", "", f"`{SHORT}` at each rate; the split "
                  "fleet speaks vLLM's protocol, so a request may run whole on any replica.", ""]
        for rate in SHORT_RATES:
            spec = f"{SHORT},rate={rate:g}"
            lines += [f"### {rate:g} requests/s", "", HEADER]
            colocated = run(spec, uniform_fleet(REPLICAS), seed)
            split = run(spec, split_fleet(4, 4), seed, "vllm")
            lines.append(_row(f"{REPLICAS} colocated", colocated) + " |")
            lines.append(_row("4 prefill + 4 decode", split)
                         + f" TTFT p50 {split['ttft_s']['p50'] / colocated['ttft_s']['p50']:.2f}x, "
                         f"E2E p50 {split['e2e_s']['p50'] / colocated['e2e_s']['p50']:.2f}x |")
            lines.append("")
    text = "\n".join(lines) + "\n"
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
