"""kvlb in front of real vLLM engines: cached tokens by policy, and how exact the predictions are.

    python -m loadtest.real_engines.e2e [--replicas 3] [--out FILE]

installs the engine when missing (loadtest/real_engines/setup.py), starts the engines and a kvlb
with `kvlb launch`, then, for each mode, empties the engines' prefix caches, starts its own
kvlb in front of them and replays one multi-turn workload through it:

- `random`: random routing;
- `approximate`: cache_aware on kvlb's own text-prefix predictions;
- `precise`: cache_aware on the engines' KV events, prompts tokenized by the model's tokenizer.

Every figure comes from the engines' own answers (`usage.prompt_tokens_details.cached_tokens`);
a prediction is the `cached` term of kvlb's `x-kvlb-route` header for the chosen replica.

The workload: conversations that share one of a few long system prompts, each turn sending
back the engine's real reply and a new question, so a turn's prompt extends the previous one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from balancer.app import start_balancer
from balancer.config import parse_settings
from balancer.protocol import REPLICA_HEADER, ROUTE_HEADER
from loadtest.procs import free_port

ENGINE_BLOCK_SIZE = 128  # vLLM's default on CPU
# 2 MiB of KV cache is 4,096 tokens (32 blocks) of the tiny model: the workload's six system
# prompts and the conversations' own turns do not fit in one engine together, so engines
# evict under every policy, precise routing included.
ENGINE_ARGS = ("--enforce-eager", "--kv-cache-memory-bytes", str(4 * 512 * 1024),
               "--max-model-len", "2048", "--served-model-name", "tiny")
MODEL_NAME = "tiny"
MODES = ("random", "approximate", "precise")
# Words the tiny model's tokenizer was trained on, so a word is one or two tokens.
WORDS = ("the quick brown fox jumps over a lazy dog system user assistant prompt document "
         "tenant turn question answer").split()


@dataclass(frozen=True)
class Turn:
    mode: str
    conversation: int
    turn: int
    replica: str
    prompt_tokens: int
    cached_tokens: int
    predicted: int | None  # None: no prediction header (random routing)


@dataclass(frozen=True)
class Workload:
    conversations: int = 18
    turns: int = 5
    system_prompts: int = 6
    system_words: int = 500
    question_words: int = 60
    max_tokens: int = 16
    concurrency: int = 4
    seed: int = 1

    def system_prompt(self, index: int) -> str:
        rng = random.Random(f"{self.seed}-system-{index}")
        return " ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(self.system_words))

    def question(self, conversation: int, turn: int) -> str:
        rng = random.Random(f"{self.seed}-q-{conversation}-{turn}")
        return " ".join(rng.choice(WORDS) for _ in range(self.question_words))


def predicted_cached(route_header: str | None) -> int | None:
    """The chosen replica's `cached` term from `x-kvlb-route: chosen=NAME k=v ...; next=...`."""
    if not route_header:
        return None
    chosen = route_header.split(";")[0].split()
    for term in chosen[1:]:
        key, _, value = term.partition("=")
        if key == "cached":
            return int(float(value))
    return None


async def run_workload(base_url: str, mode: str, workload: Workload) -> list[Turn]:
    turns: list[Turn] = []
    gate = asyncio.Semaphore(workload.concurrency)
    timeout = aiohttp.ClientTimeout(total=120)

    async def conversation(session: aiohttp.ClientSession, index: int) -> None:
        messages = [{"role": "system", "content": workload.system_prompt(index % workload.system_prompts)}]
        async with gate:
            for turn in range(workload.turns):
                messages.append({"role": "user", "content": workload.question(index, turn)})
                body = {"model": MODEL_NAME, "messages": messages, "max_tokens": workload.max_tokens,
                        "temperature": 0}
                async with session.post(f"{base_url}/v1/chat/completions", json=body) as answer:
                    payload = await answer.json(content_type=None)
                    if answer.status != 200:
                        raise RuntimeError(f"{mode}: HTTP {answer.status}: {payload}")
                    usage = payload["usage"]
                    turns.append(Turn(
                        mode, index, turn, answer.headers.get(REPLICA_HEADER, ""),
                        usage["prompt_tokens"],
                        (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
                        predicted_cached(answer.headers.get(ROUTE_HEADER)),
                    ))
                messages.append({"role": "assistant", "content": payload["choices"][0]["message"]["content"]})

    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(conversation(session, i) for i in range(workload.conversations)))
    return turns


def kvlb_settings(mode: str, port: int, engines: Sequence[str], events: Sequence[str], model_dir: str) -> Any:
    replicas = [{"url": url, "name": f"engine-{i}", "model": MODEL_NAME} for i, url in enumerate(engines)]
    config: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": port},
        "replicas": replicas,
        "policy": {"name": "random" if mode == "random" else "cache_aware", "seed": 0},
        "routing": {"route_header": True},
        "health": {"interval_s": 1.0},
    }
    if mode == "precise":
        for replica, endpoint in zip(replicas, events, strict=True):
            replica["kv_events_endpoint"] = endpoint
        config["kv_events"] = {"enabled": True, "block_size": ENGINE_BLOCK_SIZE, "tokenizer": model_dir}
    return parse_settings(config)


async def reset_caches(engines: Sequence[str]) -> None:
    """Empty every engine's prefix cache (vLLM answers this with VLLM_SERVER_DEV_MODE=1)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        for url in engines:
            async with session.post(f"{url}/reset_prefix_cache") as answer:
                if answer.status != 200:
                    raise RuntimeError(f"{url}/reset_prefix_cache: HTTP {answer.status}")


@dataclass(frozen=True)
class ModeRun:
    turns: list[Turn]
    events: dict[str, Any] | None  # precise mode's KV event counters at the end


async def run_mode(mode: str, engines: Sequence[str], events: Sequence[str], model_dir: str,
                   workload: Workload) -> ModeRun:
    await reset_caches(engines)
    running = await start_balancer(kvlb_settings(mode, free_port(), engines, events, model_dir))
    try:
        tracker = running.balancer.tracker
        stats = getattr(getattr(tracker, "events", None), "stats", None)
        if stats is not None:
            # ZMQ subscriptions take a moment to reach the publishers; events sent before
            # that are lost to this subscriber, as they would be to a kvlb started late.
            deadline = time.monotonic() + 10
            while len(stats.connected) < len(engines) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.0)
        turns = await run_workload(f"http://127.0.0.1:{running.port}", mode, workload)
        if stats is not None:
            await asyncio.sleep(0.5)  # the last events in flight
        counters = None if stats is None else {
            "stored_blocks": stats.stored_blocks, "removed_blocks": stats.removed_blocks,
            "unknown_parent": stats.unknown_parent, "gaps": stats.gaps, "batches": stats.batches,
        }
        return ModeRun(turns, counters)
    finally:
        await running.close(grace_s=1.0)


def summarize(turns: Sequence[Turn], block_size: int = ENGINE_BLOCK_SIZE) -> dict[str, Any]:
    prompt = sum(t.prompt_tokens for t in turns)
    cached = sum(t.cached_tokens for t in turns)
    predicted = [t for t in turns if t.predicted is not None]
    within = sum(1 for t in predicted if abs(t.predicted - t.cached_tokens) <= block_size)
    exact = sum(1 for t in predicted if t.predicted == t.cached_tokens)
    return {
        "requests": len(turns),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_ratio": cached / prompt if prompt else 0.0,
        "predicted_within_one_block": within / len(predicted) if predicted else None,
        "predicted_exactly": exact / len(predicted) if predicted else None,
        "replicas_used": len({t.replica for t in turns}),
    }


@dataclass
class LaunchedFleet:
    process: subprocess.Popen
    engines: list[str]
    events: list[str]
    kvlb_url: str
    log_dir: str


def launch_command(python: str, model_dir: str, replicas: int, base_port: int, events_port: int,
                   kvlb_port: int, log_dir: str) -> list[str]:
    return [
        sys.executable, "-m", "balancer", "launch", "--engine", "vllm", "--cpu",
        "--model", model_dir, "--replicas", str(replicas), "--engine-python", python,
        "--base-port", str(base_port), "--events-base-port", str(events_port),
        "--port", str(kvlb_port), "--log-dir", log_dir, "--start-timeout-s", "400",
        "--", *ENGINE_ARGS,
    ]


def _ports(count: int) -> int:
    """A base port with `count` free ports above it (below the ephemeral range)."""
    import socket

    for _ in range(100):
        base = random.randrange(20000, 32000 - count)
        free = True
        for port in range(base, base + count):
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    free = False
                    break
        if free:
            return base
    raise RuntimeError("no run of free ports")


@contextlib.asynccontextmanager
async def launched_fleet(python: str, model_dir: str, replicas: int = 3,
                         start_timeout_s: float = 420.0) -> AsyncIterator[LaunchedFleet]:
    """`kvlb launch` as a user runs it: engines and kvlb, stopped with Ctrl-C at the end."""
    base, events_base, kvlb_port = _ports(replicas), _ports(replicas), free_port()
    log_dir = tempfile.mkdtemp(prefix="kvlb-engines-")
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", HF_HUB_OFFLINE="1", HF_ENDPOINT="http://127.0.0.1:9")
    output = open(Path(log_dir) / "launch.log", "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        launch_command(python, model_dir, replicas, base, events_base, kvlb_port, log_dir),
        stdout=output, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )
    fleet = LaunchedFleet(
        process,
        [f"http://127.0.0.1:{base + i}" for i in range(replicas)],
        [f"tcp://127.0.0.1:{events_base + i}" for i in range(replicas)],
        f"http://127.0.0.1:{kvlb_port}",
        log_dir,
    )
    try:
        await _wait_ready(fleet, start_timeout_s)
        yield fleet
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        output.close()


async def _wait_ready(fleet: LaunchedFleet, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while time.monotonic() < deadline:
            if fleet.process.poll() is not None:
                break
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(f"{fleet.kvlb_url}/ready") as answer:
                    if answer.status == 200:
                        return
            await asyncio.sleep(1.0)
    log = (Path(fleet.log_dir) / "launch.log").read_text(errors="replace")
    raise RuntimeError(f"kvlb launch did not become ready (exit {fleet.process.poll()}):\n{log[-4000:]}")


async def compare_on(fleet: LaunchedFleet, model_dir: str, workload: Workload) -> dict[str, Any]:
    results: dict[str, Any] = {}
    turns: list[Turn] = []
    for mode in MODES:
        run = await run_mode(mode, fleet.engines, fleet.events, model_dir, workload)
        turns.extend(run.turns)
        results[mode] = summarize(run.turns)
        if run.events is not None:
            results[mode]["kv_events"] = run.events
    return {"workload": asdict(workload), "replicas": len(fleet.engines), "modes": results,
            "turns": [asdict(t) for t in turns]}


def print_table(report: dict[str, Any]) -> None:
    print(f"{'mode':<12} {'requests':>8} {'cached ratio':>12} {'within 1 block':>14} {'exact':>6}")
    for mode, row in report["modes"].items():
        within = row["predicted_within_one_block"]
        exact = row["predicted_exactly"]
        print(f"{mode:<12} {row['requests']:>8} {row['cached_ratio']:>12.3f} "
              f"{'-' if within is None else f'{within:.3f}':>14} {'-' if exact is None else f'{exact:.3f}':>6}")
        if "kv_events" in row:
            print(f"{'':<12} KV events: {row['kv_events']}")


def main(argv: list[str] | None = None) -> int:
    from loadtest.real_engines.setup import ensure_engine

    parser = argparse.ArgumentParser(prog="python -m loadtest.real_engines.e2e", description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=Workload.conversations)
    parser.add_argument("--turns", type=int, default=Workload.turns)
    parser.add_argument("--out", help="write every turn and the summary as JSON here")
    args = parser.parse_args(argv)
    env = ensure_engine(log=lambda line: print(line, file=sys.stderr))
    workload = Workload(conversations=args.conversations, turns=args.turns)

    async def run() -> dict[str, Any]:
        async with launched_fleet(env.python, env.model, args.replicas) as fleet:
            return await compare_on(fleet, env.model, workload)

    report = asyncio.run(run())
    print_table(report)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
