"""Through kvlb: a replica slow only at attention (long prompts) is fitted term by term from
its streamed answers, the fit is exported, and each replica's predicted time follows its
shape: one multiplier alone would give one ratio between the two at every length."""

from __future__ import annotations

import random
from contextlib import AsyncExitStack

import aiohttp

from tests.conftest import make_settings, run_balancer, serve_app
from tests.upstreams import usage_reporting_app

MODEL = "m"
# The policy's engine figures (llama-3.1-8b on an H100), at half their time so the test runs
# quickly: a replica's prefill of n tokens, and one whose attention is eight times slower.
A, B, K, TIME = 5.3, 0.0191, 7.4e-7, 0.5


def prefill_s(attention: float):  # noqa: ANN201 - a first_token_s for usage_reporting_app
    return lambda n: TIME * ((1.5 + n / 8192) * A + n * B + attention * K * n * n / 2) / 1000.0


def gauge(metrics: str, name: str, **labels: str) -> float:
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return float(next(line for line in metrics.splitlines()
                      if line.startswith(name + "{") and all(w in line for w in wanted)).split()[-1])


async def test_a_replica_slow_at_attention_is_fitted_term_by_term_and_predicted_so_at_each_length() -> None:
    async with AsyncExitStack() as stack:
        plain = await stack.enter_async_context(
            serve_app(usage_reporting_app(natural_length=4, first_token_s=prefill_s(1.0))))
        slow = await stack.enter_async_context(
            serve_app(usage_reporting_app(natural_length=4, first_token_s=prefill_s(8.0))))
        settings = make_settings([{"url": plain, "name": "plain", "model": MODEL, "labels": {"region": "a"}},
                                  {"url": slow, "name": "slow-attention", "model": MODEL, "labels": {"region": "b"}}],
                                 policy={"name": "predictive", "seed": 3}, routing={"route_header": True})
        running = await stack.enter_async_context(run_balancer(settings))
        http = await stack.enter_async_context(aiohttp.ClientSession())

        predicted: dict[str, float] = {}

        async def send(n: int, words: int, region: str | None = None) -> str:
            body = {"model": MODEL, "prompt": f"q{n} " + "word " * words, "stream": True,
                    "stream_options": {"include_usage": True}}
            headers = {"x-kvlb-allowed-regions": region} if region else {}
            async with http.post(running.url + "/v1/completions", json=body, headers=headers) as resp:
                assert resp.status == 200
                await resp.read()
                for choice in resp.headers["x-kvlb-route"].split("; "):
                    fields = dict(field.split("=", 1) for field in choice.split())
                    predicted[fields.get("chosen") or fields["next"]] = float(fields["ttft_ms"])
                return resp.headers["x-kvlb-replica"]

        async def metrics() -> str:
            async with http.get(running.url + "/metrics") as resp:
                return await resp.text()

        # One at a time, so each answer finds its replica's queue empty; prompts of every
        # length, so the terms can be told apart. Held to one region each in turn, so both
        # replicas answer every length.
        rng = random.Random(5)
        for n in range(24):
            for name, region in (("plain", "a"), ("slow-attention", "b")):
                assert await send(n, rng.randint(3_000, 12_000), region) == name
        text = await metrics()
        for name in ("plain", "slow-attention"):
            assert gauge(text, "kvlb_replica_terms_in_use", replica=name, prediction="ttft") == 1.0
        slow_attention = gauge(text, "kvlb_replica_ttft_term_scale", replica="slow-attention", term="attention")
        plain_attention = gauge(text, "kvlb_replica_ttft_term_scale", replica="plain", term="attention")
        assert slow_attention > 3 * plain_attention, text
        # Its tokens cost what the profile says on both.
        for name in ("plain", "slow-attention"):
            assert 0.25 < gauge(text, "kvlb_replica_ttft_term_scale", replica=name, term="token") < 1.0
        # Each replica's predicted time follows its shape: the slow one is somewhat slower at
        # 4k tokens and much slower at 12k, where one multiplier would say one ratio for both.
        ratios = {}
        for words in (4_000, 12_000):
            assert await send(200 + words, words) == "plain"
            truth = prefill_s(8.0)(words + 1) / prefill_s(1.0)(words + 1)
            ratios[words] = predicted["slow-attention"] / predicted["plain"]
            assert abs(ratios[words] / truth - 1) < 0.2, (words, ratios[words], truth)
        # Truth: 1.45 and 2.25. One multiplier: the same ratio at both lengths.
        assert ratios[12_000] > 1.1 * ratios[4_000], ratios

