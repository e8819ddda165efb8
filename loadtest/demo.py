"""`make demo`: a small fleet on 127.0.0.1, kvlb in front, a burst of OpenAI SDK requests.

Starts four simulated GPU replicas (`kvlb replica`, llama-3.1-8b on H100, ten times faster
than the model) and kvlb as child processes, sends chat and completion requests, streaming
and not, through the unchanged `openai` client, prints which replica served each and what
its KV cache held, then compares random and predictive routing live on the same chat
sessions, and stops everything it started, also on Ctrl-C or error.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

import openai

from balancer.protocol import REPLICA_HEADER
from loadtest.client.summary import Results
from loadtest.client.workloads import load_workload
from loadtest.compare.compare import compare_live, compare_offline, finish, print_comparison
from loadtest.procs import free_port, start_process, stop_process, wait_for_http
from loadtest.simulator.fleetspec import uniform_fleet

REPLICAS = 4
MODEL = "demo-model"
PROFILE = "llama-3.1-8b-h100"
TIME_SCALE = 10
PROMPTS = [
    "Explain KV caches in one line.",
    "Why does prefix reuse cut time to first token?",
    "Name three LLM serving engines.",
    "What does a load balancer do?",
]


def write_config(path: Path, kvlb_port: int, replica_ports: list[int]) -> None:
    zones = ["us-east-1a", "us-east-1b"]
    lines = [
        f"listen: {{host: 127.0.0.1, port: {kvlb_port}}}",
        "policy: {name: predictive}",
        "health: {interval_s: 1.0}",
        "replicas:",
    ]
    for i, port in enumerate(replica_ports):
        lines += [
            f"  - url: http://127.0.0.1:{port}",
            f"    name: replica-{i}",
            f"    model: {MODEL}",
            f"    labels: {{region: us-east, zone: {zones[i % 2]}, tier: committed}}",
        ]
    path.write_text("\n".join(lines) + "\n")


SYSTEM = "You are a terse assistant for platform engineers who run LLM inference fleets. " * 8


async def burst(base_url: str) -> list[tuple[str, str, int, int, str]]:
    """Chat and completion requests, streamed and not; (kind, replica, prompt, cached, text)."""
    served: list[tuple[str, str, int, int, str]] = []
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="demo", max_retries=0, timeout=30) as oai:

        def cached_of(usage) -> int:
            details = getattr(usage, "prompt_tokens_details", None)
            return (details.cached_tokens or 0) if details else 0

        async def chat(prompt: str, stream: bool) -> None:
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
            if stream:
                raw = await oai.chat.completions.with_raw_response.create(
                    model=MODEL, messages=messages, max_tokens=6, stream=True,
                    stream_options={"include_usage": True},
                )
                text, usage = "", None
                async for chunk in raw.parse():
                    if chunk.choices:
                        text += chunk.choices[0].delta.content or ""
                    usage = chunk.usage or usage
                kind = "chat, streamed"
            else:
                raw = await oai.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=6)
                answer = raw.parse()
                text, usage, kind = answer.choices[0].message.content, answer.usage, "chat"
            served.append((kind, raw.headers[REPLICA_HEADER], usage.prompt_tokens, cached_of(usage), text))

        async def completion(prompt: str, stream: bool) -> None:
            prompt = SYSTEM + prompt
            if stream:
                raw = await oai.completions.with_raw_response.create(
                    model=MODEL, prompt=prompt, max_tokens=6, stream=True, stream_options={"include_usage": True}
                )
                text, usage = "", None
                async for chunk in raw.parse():
                    if chunk.choices:
                        text += chunk.choices[0].text
                    usage = chunk.usage or usage
                kind = "completion, streamed"
            else:
                raw = await oai.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=6)
                answer = raw.parse()
                text, usage, kind = answer.choices[0].text, answer.usage, "completion"
            served.append((kind, raw.headers[REPLICA_HEADER], usage.prompt_tokens, cached_of(usage), text))

        for _wave in range(2):  # the second wave finds the shared system prompt in some caches
            jobs = []
            for i in range(8):
                prompt = PROMPTS[i % len(PROMPTS)]
                kind = (chat, completion)[i % 2]
                jobs.append(kind(prompt, stream=(i // 2) % 2 == 1))
            await asyncio.gather(*jobs)
        models = await oai.models.list()
        print(f"GET /v1/models through kvlb: {[m.id for m in models.data]}")
    return served


async def main() -> int:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    replica_ports = [free_port() for _ in range(REPLICAS)]
    kvlb_port = free_port()
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "balancer.yaml"
        write_config(config, kvlb_port, replica_ports)
        try:
            for port in replica_ports:
                procs.append(start_process(
                    [sys.executable, "-m", "balancer", "replica", "--port", str(port),
                     "--profile", PROFILE, "--model", MODEL, "--time-scale", str(TIME_SCALE)], env))
            for port in replica_ports:
                await wait_for_http(f"http://127.0.0.1:{port}/health")
            procs.append(start_process([sys.executable, "-m", "balancer", "serve", "--config", str(config)], env))
            base_url = f"http://127.0.0.1:{kvlb_port}"
            await wait_for_http(base_url + "/ready")
            print(f"kvlb on {base_url} in front of {REPLICAS} simulated {PROFILE} replicas "
                  f"(time scale {TIME_SCALE}), policy predictive\n")
            served = await burst(base_url)
            print(f"\n{'#':>3}  {'request':<22} {'served by':<10} {'prompt':>6} {'cached':>6}  answer")
            for i, (kind, replica, prompt_tokens, cached, text) in enumerate(served, 1):
                print(f"{i:>3}  {kind:<22} {replica:<10} {prompt_tokens:>6} {cached:>6}  {text.strip()[:40]}")
            counts = Counter(replica for _, replica, *_ in served)
            print("\nrequests per replica: " + ", ".join(f"{r}={n}" for r, n in sorted(counts.items())))
        finally:
            for proc in reversed(procs):
                stop_process(proc)
    await compare_policies()
    print("stopped every process the demo started")
    return 0


# Chat sessions with long system prompts, each turn extending the last: where routing decides
# whether a turn finds its conversation in cache. About 40 s of model time, 4 s at time scale 10.
COMPARE_WORKLOAD = (
    "multi-turn,sessions=40,turns=5,system_tokens=6000,user_tokens=200,output_tokens=64,think_s=4,rate=3"
)
REPORT_DIR = Path("demo-report")


async def compare_policies() -> None:
    """The same chat sessions live through kvlb twice, with fresh replicas each time: random
    routing, then predictive."""
    workload = load_workload(COMPARE_WORKLOAD)
    print(f"\ncomparing random and predictive routing, live through kvlb and {REPLICAS} fresh simulated "
          f"replicas each:\n  {workload.description}")
    results = await compare_live(
        workload, ["random", "predictive"], REPORT_DIR, replicas=REPLICAS, profile=PROFILE,
        time_scale=TIME_SCALE, progress=False,
    )
    finish(results, REPORT_DIR, workload=workload, seed=0, mode="live (make demo)",
           fleet=f"{REPLICAS} x {PROFILE} (simulated replica processes, time scale {TIME_SCALE})",
           command=f"kvlb compare --live --workload '{COMPARE_WORKLOAD}' --policies random,predictive "
                   f"--replicas {REPLICAS} --out {REPORT_DIR}")
    print("\nTimes in ms of model time (the replicas run ten times faster than the GPUs they model).\n")
    print_comparison(results)
    offline = compare_offline(workload, uniform_fleet(REPLICAS, PROFILE), ["random", "predictive"],
                              REPORT_DIR / "offline", progress=False)
    print_side_by_side(results, offline)
    print(f"\nfull report with plots: {REPORT_DIR / 'report.md'}")


def print_side_by_side(live: Results, offline: Results) -> None:
    """Live beside the offline simulator of the same workload and fleet. A live time is a real
    time multiplied by the time scale, so the milliseconds the client, the HTTP hops and kvlb
    spend per request (real time, not model time) come out TIME_SCALE times larger: that, not
    the routing, is most of what separates the two at the median."""
    print("\nthe same workload offline (kvlb simulate, no real time: every figure is model time):\n")
    print(f"  {'policy':<12} {'':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'E2E p50':>9} {'cache hit':>9}")
    for name in live:
        rows = (("live", live[name][0]), ("offline", offline[name][0]))
        for label, summary in rows:
            ttft, e2e = summary["ttft_s"], summary["e2e_s"]
            print(f"  {name if label == 'live' else '':<12} {label:>8} {_ms(ttft['p50'])} {_ms(ttft['p99'])} "
                  f"{_ms(e2e['p50'])} {summary['cache_hit_ratio']:>9.3f}")
    print(f"  Live times carry each request's real overhead (client, HTTP, kvlb: a few ms) times "
          f"{TIME_SCALE}; the offline ones carry none.")


def _ms(seconds: float | None) -> str:
    return f"{'-':>9}" if seconds is None else f"{seconds * 1000:>7.0f}ms"


if __name__ == "__main__":
    import uvloop

    sys.exit(uvloop.run(main()))
