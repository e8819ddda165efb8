"""Disaggregated fleets offline, through the same pair-choosing code as `kvlb serve`: the
prefill replica's work and the transfer come before the decode replica's first token."""

from __future__ import annotations

import pytest

from balancer.config import DisaggregationSettings, PolicySettings
from loadtest.client.workloads import load_workload
from loadtest.compare import pd_report
from loadtest.simulator.fleetspec import parse_fleet, uniform_fleet
from loadtest.simulator.simulator import simulate

LONG = "long-prompt,requests=40,rate=0.5,min_prompt_tokens=8000,max_prompt_tokens=12000,max_output_tokens=220"


def split(zone_only: bool = False) -> object:
    label = {"zone": "z1"} if zone_only else {"host": "node-0"}
    return parse_fleet({"groups": [{"count": 2, "role": "prefill", **label},
                                   {"count": 2, "role": "decode", **label}]})


def run(spec: str, fleet: object, settings: DisaggregationSettings | None = None) -> list:
    workload = load_workload(spec)
    return simulate(fleet, workload.requests, PolicySettings("predictive", {}, 0),
                    disaggregation=settings).records


def test_every_request_decodes_on_the_decode_pool_after_its_transfer() -> None:
    fast = run(LONG, split())
    assert all(r.status == 200 for r in fast)
    assert {r.replica for r in fast} <= {"replica-2", "replica-3"}  # the decode group
    assert {r.replica for r in fast} == {"replica-2", "replica-3"}  # both used
    # The same requests over a slower link: each first token comes that much later.
    slow = run(LONG, split(zone_only=True))  # same zone, not same host: 100 Gb/s, not 400
    settings = DisaggregationSettings()
    for f, s in zip(fast, slow, strict=True):
        extra_ms = f.prompt_tokens * settings.kv_bytes_per_token * 8 * (1 / 100e9 - 1 / 400e9) * 1000
        assert (s.ttft_s - f.ttft_s) * 1000 > 0.5 * extra_ms


def test_a_long_prompt_prefills_off_the_decode_replicas_and_their_tokens_stay_smooth() -> None:
    # Busy enough that colocated decodes share their replica with other prompts' prefill.
    spec = LONG.replace("rate=0.5", "rate=3")
    colocated = sorted(r.tpot_s for r in run(spec, uniform_fleet(4)))
    disaggregated = sorted(r.tpot_s for r in run(spec, split()))
    assert disaggregated[-1] < colocated[-1]
    assert disaggregated[len(disaggregated) // 2] < colocated[len(colocated) // 2]


def test_mostly_cached_prompts_run_whole_under_vllms_protocol() -> None:
    spec = "shared-prefix,groups=1,prompts_per_group=60,system_tokens=6000,question_tokens=50,rate=4"
    records = run(spec, split(), DisaggregationSettings(protocol="vllm"))
    assert all(r.status == 200 for r in records)
    # After the first, each prompt is cached bar its question: it runs on a prefill replica too.
    assert {"replica-0", "replica-1"} & {r.replica for r in records}
    assert sum(r.cached_tokens for r in records) / sum(r.prompt_tokens for r in records) > 0.8


def test_decode_halves_fit_their_replicas_decode_speed_and_a_slow_one_gets_fewer() -> None:
    from loadtest.simulator.simulator import Simulator

    # One decode replica decodes about twice as slowly as kvlb's model of it (a 70B profile
    # where kvlb prices every replica as the 8B one).
    fleet = parse_fleet({"groups": [{"count": 2, "role": "prefill", "host": "node-0"},
                                    {"count": 2, "role": "decode", "host": "node-0"},
                                    {"count": 1, "role": "decode", "host": "node-0",
                                     "profile": "llama-3.1-70b-h100-tp4"}]})
    spec = LONG.replace("requests=40", "requests=120").replace("rate=0.5", "rate=2")
    shares = {}
    for fitted in (True, False):
        policy = PolicySettings("predictive", {"decode_speed_tolerance": 0.3, "use_fitted_speed": fitted}, 0)
        simulator = Simulator(fleet, policy, None, disaggregation=DisaggregationSettings())
        records = simulator.run(load_workload(spec).requests).records
        assert all(r.status == 200 for r in records)
        shares[fitted] = sum(r.replica == "replica-4" for r in records) / len(records)
        decode = [r for r in simulator.fleet.replicas if r.settings.role == "decode"]
        # Every decode replica's speed is fitted from its streamed answers, whichever choice.
        assert all(r.itl_samples > 0 for r in decode)
        if fitted:
            slow, *fast = sorted(decode, key=lambda r: -r.itl_scale)
            assert slow.name == "replica-4" and slow.itl_scale > 1.5 * max(r.itl_scale for r in fast)
    assert shares[True] < 0.6 * shares[False], shares


def test_the_report_refuses_a_split_it_cannot_build(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("4x4:vllm", "4+4:nixl", "0+8:sglang", "4+4"):
        with pytest.raises(SystemExit) as exited:
            pd_report.main(["--splits", bad])
        assert exited.value.code == 2
    assert "PREFILL+DECODE" in capsys.readouterr().err
