"""Fitted terms benchmark: replicas that depart from their profile in shape, not only in level.

Runs the offline simulator (seed 0) on fleets whose replicas are not what the policy's
engine figures say, each twice: `predictive` as it ships, and with `use_fitted_terms: false`
(one multiplier per replica on the whole prediction). Printed per run: TTFT p50, p99 and
mean, cache hit, and the error of the policy's own prediction of each answer's time to first
token (`ttft_ms` of the chosen replica, against what it took), as |log(observed /
predicted)| at p50 and p90 over the answers that found their replica's prefill queue empty,
the ones the prediction can know; then the share of the long prompts (over 16k tokens) that
the odd replicas served.

Fleets (balancer/routing/term_fit.py says why a card can differ in shape):
- h100+h200: 4 llama-3.1-8b on H100 and 4 on H200, priced as H100s. An H200 prefills short
  prompts no faster (a tenth slower per token) and long ones a quarter faster (its attention
  term is a quarter of the H100's).
- 70b h100+h200: the same with llama-3.1-70b at TP4, priced as the H100s.
- slow attention: 8 H100s, one of which runs attention five times slower than its profile
  (an engine fallen back to a slower attention kernel), all else as the profile says.
- alike: 8 H100s, the control: the fitted terms should change nothing.

    python -m loadtest.bench.term_fit [--requests 800]
"""

from __future__ import annotations

import argparse
import dataclasses
import math

from balancer.config import PolicySettings
from balancer.routing.core import PREFILLING
from loadtest.client.summary import summarize
from loadtest.client.workloads import load_workload
from loadtest.replica.profiles import PROFILES
from loadtest.simulator.fleetspec import FleetPlan, ReplicaPlan
from loadtest.simulator.simulator import Simulator
from policies.base import TTFT_TERM

LONG = 16_000
H100, H200 = PROFILES["llama-3.1-8b-h100"], PROFILES["llama-3.1-8b-h200"]
H100_70B, H200_70B = PROFILES["llama-3.1-70b-h100-tp4"], PROFILES["llama-3.1-70b-h200-tp4"]


def fleet(profiles: list) -> FleetPlan:
    return FleetPlan(tuple(ReplicaPlan(f"replica-{i}", p, {}, context_limit=262144) for i, p in enumerate(profiles)))


def engine_params(profile) -> dict:  # noqa: ANN001 - a loadtest.replica.profiles.Profile
    return {"iteration_ms": profile.a_ms, "prefill_ms_per_token": profile.b_ms_per_token,
            "attention_ms_per_token2": profile.k_ms_per_token2, "decode_iteration_ms": profile.d0_ms,
            "decode_ms_per_seq": profile.d1_ms_per_seq, "decode_ms_per_context_token": profile.d2_ms_per_ctx_token}


def long_prompts(requests: int, rate: float) -> str:
    return (f"long-prompt,requests={requests},min_prompt_tokens=500,max_prompt_tokens=32000,"
            f"min_output_tokens=50,max_output_tokens=200,rate={rate}")


def scenarios(requests: int) -> list[tuple[str, FleetPlan, dict, str, set[str]]]:
    slow_attention = dataclasses.replace(H100, k_ms_per_token2=H100.k_ms_per_token2 * 5)
    return [
        ("h100+h200", fleet([H100] * 4 + [H200] * 4), {}, long_prompts(requests, 6),
         {f"replica-{i}" for i in range(4, 8)}),
        ("70b h100+h200", fleet([H100_70B] * 4 + [H200_70B] * 4), engine_params(H100_70B),
         long_prompts(requests // 2, 1.2), {f"replica-{i}" for i in range(4, 8)}),
        ("slow attention", fleet([slow_attention] + [H100] * 7), {}, long_prompts(requests, 6), {"replica-0"}),
        ("alike", fleet([H100] * 8), {}, long_prompts(requests, 6), set()),
    ]


def run(plan: FleetPlan, params: dict, spec: str, odd: set[str]) -> dict:
    sim = Simulator(plan, PolicySettings("predictive", params, 0))
    core = sim.core
    errors: list[float] = []
    first_byte = core.first_byte

    def watched(journey, now=None):  # noqa: ANN001, ANN202 - the core's own signature
        if now is not None and journey.phase == PREFILLING and journey.alone and journey.features.stream:
            predicted = journey.ranking[len(journey.attempts) - 1].terms.get(TTFT_TERM, 0.0)
            observed = (now - journey.sent_at) * 1000.0
            if predicted > 0 and observed > 0:
                errors.append(abs(math.log(observed / predicted)))
        return first_byte(journey, now)

    core.first_byte = watched
    result = sim.run(load_workload(spec).requests)
    summary = summarize(result.records, result.duration_s)
    long = [r for r in result.records if r.prompt_tokens > LONG and r.replica]
    errors.sort()
    return {
        "ttft": summary["ttft_s"], "hit": summary["cache_hit_ratio"],
        "error_p50": errors[len(errors) // 2] if errors else math.nan,
        "error_p90": errors[int(len(errors) * 0.9)] if errors else math.nan,
        "odd_long": sum(r.replica in odd for r in long) / max(1, len(long)) if odd else math.nan,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=800)
    args = parser.parse_args(argv)
    print("| fleet | fitted terms | TTFT p50 ms | p99 ms | mean ms | cache hit | prediction error p50 | p90 "
          "| long prompts on the odd replicas |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, plan, params, spec, odd in scenarios(args.requests):
        for terms in (False, True):
            r = run(plan, {**params, "use_fitted_terms": terms}, spec, odd)
            t = r["ttft"]
            share = "" if math.isnan(r["odd_long"]) else f"{r['odd_long']:.0%}"
            print(f"| {name} | {'on' if terms else 'off'} | {t['p50'] * 1000:,.0f} | {t['p99'] * 1000:,.0f} "
                  f"| {t['mean'] * 1000:,.0f} | {r['hit']:.3f} | {math.exp(r['error_p50']) - 1:.1%} "
                  f"| {math.exp(r['error_p90']) - 1:.1%} | {share} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
