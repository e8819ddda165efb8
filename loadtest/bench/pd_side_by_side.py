"""kvlb and SGLang's router, each in PD mode, in front of the same simulated prefill and decode
replicas: the independent check that kvlb speaks SGLang's disaggregation protocol as SGLang's
own router does, and a comparison on one workload.

    python -m loadtest.bench.pd_side_by_side [--prefill 2] [--decode 2] [--time-scale 10]
        [--workload SPEC] [--router '.venv-sglang-router/bin/python -m sglang_router.launch_router']

Fresh replicas for each router (no run inherits the other's caches), SGLang's flags
(`--disaggregation-mode prefill|decode`, `--disaggregation-bootstrap-port`). SGLang's router
runs as `--pd-disaggregation --prefill URL BOOTSTRAP_PORT ... --decode URL ...`, offline
(HF_HUB_OFFLINE=1, HF_ENDPOINT to 127.0.0.1:9). Printed per router: requests, errors, the
cache hit the decode replicas report (the prefill side's), and TTFT, TPOT and end-to-end
p50/p99 in model time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import yaml

from loadtest.client.runner import run_load
from loadtest.client.summary import summarize
from loadtest.client.workloads import load_workload
from loadtest.procs import free_port, start_process, stop_process, wait_for_http
from loadtest.replica.launch import ReplicaProcess
from loadtest.simulator.cli import HARNESS_LIMITS

MODEL = "sim-model"
DEFAULT_ROUTER = ".venv-sglang-router/bin/python -m sglang_router.launch_router"
DEFAULT_WORKLOAD = "multi-turn,sessions=16,turns=4,system_tokens=3000,user_tokens=300,output_tokens=64,think_s=2,rate=2"


def replicas(stack: ExitStack, prefill: int, decode: int, time_scale: float) -> tuple[list, list]:
    base = ["--model", MODEL, "--time-scale", str(time_scale)]
    p = [stack.enter_context(ReplicaProcess(base + ["--disaggregation-mode", "prefill"], pick_bootstrap_port=True))
         for _ in range(prefill)]
    d = [stack.enter_context(ReplicaProcess(base + ["--disaggregation-mode", "decode"])) for _ in range(decode)]
    return p, d


def kvlb_argv(port: int, prefill: list, decode: list, directory: str) -> list[str]:
    entries: list[dict[str, Any]] = [
        {"url": r.url, "name": f"prefill-{i}", "model": MODEL, "role": "prefill", "bootstrap_port": r.bootstrap_port}
        for i, r in enumerate(prefill)]
    entries += [{"url": r.url, "name": f"decode-{i}", "model": MODEL, "role": "decode"} for i, r in enumerate(decode)]
    config = {"listen": {"host": "127.0.0.1", "port": port}, "replicas": entries,
              "limits": {"max_in_flight": HARNESS_LIMITS.max_in_flight}, "disaggregation": {"protocol": "sglang"}}
    path = Path(directory) / "kvlb-pd.yaml"
    path.write_text(yaml.safe_dump(config))
    return [sys.executable, "-m", "balancer", "serve", "--config", str(path)]


def sglang_argv(router: str, port: int, prefill: list, decode: list) -> list[str]:
    argv = shlex.split(router) + ["--host", "127.0.0.1", "--port", str(port), "--pd-disaggregation"]
    for r in prefill:
        argv += ["--prefill", r.url, str(r.bootstrap_port)]
    for r in decode:
        argv += ["--decode", r.url]
    return argv


async def one_run(name: str, args: argparse.Namespace, directory: str) -> dict[str, Any]:
    workload = load_workload(args.workload)
    with ExitStack() as stack:
        prefill, decode = replicas(stack, args.prefill, args.decode, args.time_scale)
        port = free_port()
        if name == "kvlb":
            argv, ready = kvlb_argv(port, prefill, decode, directory), "/ready"
        else:
            argv, ready = sglang_argv(args.router, port, prefill, decode), "/health"
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_ENDPOINT="http://127.0.0.1:9")
        proc = start_process(argv, env)
        try:
            await wait_for_http(f"http://127.0.0.1:{port}{ready}", timeout_s=60)
            records, meta = await run_load(f"http://127.0.0.1:{port}", workload.requests, model=MODEL,
                                           time_scale=args.time_scale, timeout_s=120.0, progress=False)
        finally:
            stop_process(proc)
        return summarize(records, meta.pop("duration_s"), meta=meta)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.0f}"


async def main_async(args: argparse.Namespace) -> int:
    print(f"{args.prefill} prefill + {args.decode} decode simulated replicas (SGLang's protocol), "
          f"time scale {args.time_scale:g}; workload: {args.workload}\n")
    print("| router | requests | errors | cache hit | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | E2E p50 | E2E p99 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="kvlb-pd-") as directory:
        for name in ("kvlb", "sglang_router"):
            s = await one_run(name, args, directory)
            print(f"| {name} | {s['requests']} | {s['errors']} | {s['cache_hit_ratio']:.3f} | {_ms(s['ttft_s']['p50'])} | "
                  f"{_ms(s['ttft_s']['p99'])} | {_ms(s['tpot_s']['p50'])} | {_ms(s['tpot_s']['p99'])} | "
                  f"{_ms(s['e2e_s']['p50'])} | {_ms(s['e2e_s']['p99'])} |", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefill", type=int, default=2)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--time-scale", type=float, default=10.0)
    parser.add_argument("--workload", default=DEFAULT_WORKLOAD)
    parser.add_argument("--router", default=DEFAULT_ROUTER, help="SGLang's router command, without its flags")
    return asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
