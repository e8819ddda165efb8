"""Soak benchmark: steady open-loop load through kvlb while replicas are killed and restarted.

Starts, all on 127.0.0.1: `--replicas` simulated GPU replicas (`kvlb replica`, time scale 20)
and kvlb in front of them (`kvlb serve --config FILE`, a YAML written to a temporary folder:
the replicas, `--policy`, health checks every second taking a replica out after one failure,
a 5 s first-byte timeout). Then, for `--minutes`, sends chat completions open-loop (Poisson
arrivals at `--rate` per second, whether or not earlier ones finished): streamed and not, in
"sessions" that share a few long system prompts and grow a short conversation, so the prefix
cache matters. Every `--restart-every-s` one replica (in turn) is killed with SIGKILL and
started again on the same port.

Each request is recorded: status, streamed or not, whether its response had started (a 2xx
status line and headers reached the client), and any error body or SSE error event. Every
10 s a progress line shows the counts and kvlb's resident memory (VmRSS). At the end:

- failures that could have been retried: a non-2xx answer or a connection error before the
  response started. kvlb promises failover before the first byte, so the goal is zero;
- started streams that ended with kvlb's SSE error event while their replica had just been
  killed: expected, counted apart;
- other failures (a started response cut without the error event, an error event with no
  kill to explain it, a malformed answer, a client timeout): also a goal of zero;
- kvlb's RSS one minute into the load and at the end, and the growth (goal under 10 %);
- kvlb's CPU seconds per request, and latency p50/p99 (whole answer) of the successes.

The exit status is 1 when a goal is missed. Logs of kvlb and the replicas stay in a folder
whose path is printed. Every process started is stopped at the end, on Ctrl-C, SIGTERM or an
error.

    python -m loadtest.bench.soak [--minutes 10] [--replicas 4] [--rate 40] [--restart-every-s 60]
                            [--policy cache_aware]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

from balancer.protocol import REPLICA_HEADER, SESSION_HEADER
from loadtest import procs
from loadtest.procs import free_port, read_cpu_seconds, stop_process, wait_for_http

MODEL = "soak-model"
PROFILE = "llama-3.1-8b-h100"
TIME_SCALE = 20
SAMPLE_EVERY_S = 10.0
RSS_BASELINE_AT_S = 60.0
RSS_GROWTH_GOAL = 0.10
CLIENT_TIMEOUT_S = 30.0
# A broken stream counts as caused by a kill when it ended this close after one, on that replica.
KILL_WINDOW_S = 5.0

SYSTEM_PROMPTS = 6
SESSIONS = 48
TURNS = 6  # a session's conversation starts over after this many answered turns
TOPICS = [
    "prefix caching", "continuous batching", "chunked prefill", "speculative decoding",
    "tensor parallelism", "paged attention", "quantisation", "request routing",
    "admission control", "autoscaling", "KV cache eviction", "load shedding",
]


def system_prompt(i: int) -> str:
    # A few hundred words each, distinct from the first block on.
    rules = " ".join(
        f"Rule {n}: when asked about {TOPICS[(i + n) % len(TOPICS)]}, answer in plain words, cite the "
        f"relevant knob, and say what it costs in latency and memory on fleet {i}."
        for n in range(14)
    )
    return f"System prompt number {i}. You are a terse assistant for inference platform engineers. {rules}"


SYSTEMS = [system_prompt(i) for i in range(SYSTEM_PROMPTS)]


@dataclass(slots=True)
class Session:
    """A conversation: what is sent depends only on (session, turn), so the set of distinct
    prompts stays finite and kvlb's prefix index reaches a steady size within the first minute."""

    index: int
    turns: list[tuple[str, str]] = field(default_factory=list)  # answered (user, assistant)

    def next_request(self, max_tokens_cap: int) -> tuple[dict, int]:
        turn = len(self.turns)
        messages = [{"role": "system", "content": SYSTEMS[self.index % SYSTEM_PROMPTS]}]
        for user, assistant in self.turns:
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        topic = TOPICS[(self.index * 7 + turn) % len(TOPICS)]
        messages.append({"role": "user", "content": f"Session {self.index}, question {turn}: how does {topic} "
                                                    f"interact with what we discussed?"})
        max_tokens = 8 + (self.index * 5 + turn * 3) % max(1, max_tokens_cap - 7)  # 8..cap
        return {"model": MODEL, "messages": messages, "max_tokens": max_tokens,
                "temperature": 0, "user": f"session-{self.index}"}, turn

    def answered(self, turn: int, user: str, assistant: str) -> None:
        if turn == len(self.turns):  # an overlapping request may have answered this turn already
            self.turns.append((user, assistant))
            if len(self.turns) >= TURNS:
                self.turns.clear()


@dataclass(slots=True)
class Record:
    sent_at: float  # seconds since the load started
    streaming: bool
    status: int = 0  # 0: no status line (connection error or timeout before it)
    started: bool = False  # a 2xx status line and headers arrived
    done: bool = False  # a complete answer: [DONE] for streams, a parsed body otherwise
    ended_at: float = 0.0
    replica: str = ""
    error: str = ""  # error body, SSE error event or exception
    sse_error: bool = False
    lag_s: float = 0.0  # how late it was sent against the arrival schedule


@dataclass(slots=True)
class Kill:
    at: float  # seconds since the load started
    replica: str
    back_after_s: float | None = None  # until the new process answered /health


def start_logged(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """Like procs.start_process (own session, dies with this process), output appended to `log`."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=procs._die_with_parent if sys.platform == "linux" else None,
        )


def read_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def write_config(path: Path, kvlb_port: int, replica_ports: list[int], policy: str) -> None:
    lines = [
        f"listen: {{host: 127.0.0.1, port: {kvlb_port}}}",
        f"policy: {{name: {policy}}}",
        "health: {interval_s: 1, unhealthy_threshold: 1}",
        "timeouts: {first_byte_s: 5}",
        "replicas:",
    ]
    for i, port in enumerate(replica_ports):
        lines += [f"  - url: http://127.0.0.1:{port}", f"    name: replica-{i}", f"    model: {MODEL}"]
    path.write_text("\n".join(lines) + "\n")


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Soak:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        ports: list[int] = []
        while len(ports) < args.replicas + 1:  # free_port reserves nothing: keep them distinct
            if (port := free_port()) not in ports:
                ports.append(port)
        self.kvlb_port, *self.replica_ports = ports
        self.replicas: list[subprocess.Popen | None] = [None] * args.replicas
        self.kvlb: subprocess.Popen | None = None
        self.records: list[Record] = []
        self.kills: list[Kill] = []
        self.sessions = [Session(i) for i in range(SESSIONS)]
        self.rng = random.Random(args.seed)
        self.t0 = 0.0
        self.in_flight = 0
        self.rss: list[tuple[float, int]] = []

    # -- processes ---------------------------------------------------------------------------

    def start_replica(self, i: int) -> None:
        argv = [sys.executable, "-m", "balancer", "replica", "--port", str(self.replica_ports[i]),
                "--profile", PROFILE, "--model", MODEL, "--time-scale", str(TIME_SCALE)]
        self.replicas[i] = start_logged(argv, self.env, self.workdir / f"replica-{i}.log")

    def kill_replica(self, i: int) -> None:
        proc = self.replicas[i]
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        proc.wait()
        self.replicas[i] = None

    async def start_all(self) -> None:
        config = self.workdir / "balancer.yaml"
        write_config(config, self.kvlb_port, self.replica_ports, self.args.policy)
        for i in range(self.args.replicas):
            self.start_replica(i)
        for port in self.replica_ports:
            await wait_for_http(f"http://127.0.0.1:{port}/health", timeout_s=60)
        self.kvlb = start_logged([sys.executable, "-m", "balancer", "serve", "--config", str(config)],
                                 self.env, self.workdir / "kvlb.log")
        await wait_for_http(f"http://127.0.0.1:{self.kvlb_port}/ready", timeout_s=60)

    def stop_all(self) -> None:
        # kvlb first, so that it does not see its replicas go.
        if self.kvlb is not None:
            stop_process(self.kvlb)
        for i, proc in enumerate(self.replicas):
            if proc is not None:
                stop_process(proc)
                self.replicas[i] = None

    # -- load --------------------------------------------------------------------------------

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def one_request(self, http: aiohttp.ClientSession, url: str, lag_s: float) -> None:
        session = self.sessions[self.rng.randrange(SESSIONS)]
        body, turn = session.next_request(self.args.max_tokens)
        roll = self.rng.random()
        streaming = roll < 0.5
        if streaming:
            body["stream"] = True
            if roll < 0.25:
                body["stream_options"] = {"include_usage": True}
        rec = Record(sent_at=self.now(), streaming=streaming, lag_s=lag_s)
        self.records.append(rec)
        self.in_flight += 1
        headers = {"Content-Type": "application/json", SESSION_HEADER: body["user"]}
        answer = ""
        try:
            async with http.post(url, data=orjson.dumps(body), headers=headers) as resp:
                rec.status = resp.status
                rec.replica = resp.headers.get(REPLICA_HEADER, "")
                if not 200 <= resp.status < 300:
                    rec.error = (await resp.text(errors="replace"))[:1000]
                    return
                rec.started = True
                if not streaming:
                    data = orjson.loads(await resp.read())
                    answer = data["choices"][0]["message"]["content"]
                    rec.done = True
                else:
                    pieces = []
                    async for raw in resp.content:
                        line = raw.strip()
                        if not line.startswith(b"data:"):
                            continue
                        payload = line[5:].strip()
                        if payload == b"[DONE]":
                            rec.done = True
                            continue
                        event = orjson.loads(payload)
                        if "error" in event:
                            rec.sse_error = True
                            rec.error = payload.decode(errors="replace")[:1000]
                            continue
                        for choice in event.get("choices") or ():
                            pieces.append((choice.get("delta") or {}).get("content") or "")
                    answer = "".join(pieces)
                    if rec.sse_error:
                        rec.done = False
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError, IndexError, TypeError) as exc:
            rec.done = False
            rec.error = rec.error or f"{exc.__class__.__name__}: {exc}"[:1000]
        finally:
            rec.ended_at = self.now()
            self.in_flight -= 1
        if rec.done:
            session.answered(turn, body["messages"][-1]["content"], answer)

    async def drive(self, http: aiohttp.ClientSession, duration_s: float) -> set[asyncio.Task]:
        url = f"http://127.0.0.1:{self.kvlb_port}/v1/chat/completions"
        tasks: set[asyncio.Task] = set()
        due = 0.0
        while True:
            due += self.rng.expovariate(self.args.rate)
            if due >= duration_s:
                break
            wait = due - self.now()
            if wait > 0:
                await asyncio.sleep(wait)
            task = asyncio.create_task(self.one_request(http, url, max(0.0, -wait)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        return tasks

    async def restarts(self, duration_s: float) -> None:
        every = self.args.restart_every_s
        if every <= 0:
            return
        n = 0
        while (n + 1) * every < duration_s:
            await asyncio.sleep((n + 1) * every - self.now())
            i = n % self.args.replicas
            self.kill_replica(i)
            kill = Kill(at=self.now(), replica=f"replica-{i}")
            self.kills.append(kill)
            self.start_replica(i)
            try:
                await wait_for_http(f"http://127.0.0.1:{self.replica_ports[i]}/health", timeout_s=60)
                kill.back_after_s = self.now() - kill.at
            except TimeoutError:
                print(f"[{self.now():6.1f}s] replica-{i} did not come back within 60 s", flush=True)
            n += 1

    def counts(self) -> dict[str, int]:
        c = {"sent": len(self.records), "ok": 0, "retryable": 0, "kill_broken": 0, "other": 0}
        for rec in self.records:
            if rec.ended_at == 0.0:
                continue
            c[self.classify(rec)] += 1
        return c

    def classify(self, rec: Record) -> str:
        if rec.done:
            return "ok"
        if not rec.started:
            return "retryable"
        if rec.sse_error and self.kill_explains(rec):
            return "kill_broken"
        return "other"

    def kill_explains(self, rec: Record) -> bool:
        return any(k.replica == rec.replica and rec.sent_at <= k.at and k.at <= rec.ended_at <= k.at + KILL_WINDOW_S
                   for k in self.kills)

    def nearest_kill(self, t: float) -> str:
        if not self.kills:
            return "no kill"
        times = [k.at for k in self.kills]
        j = bisect.bisect_left(times, t)
        best = min((k for k in self.kills[max(0, j - 1):j + 1]), key=lambda k: abs(k.at - t))
        return f"{best.replica} killed at {best.at:.1f}s ({t - best.at:+.2f}s)"

    async def sample(self, cpu0: float) -> None:
        assert self.kvlb is not None
        n = 1
        while True:
            await asyncio.sleep(max(0.0, n * SAMPLE_EVERY_S - self.now()))
            t = self.now()
            rss = read_rss_bytes(self.kvlb.pid)
            self.rss.append((t, rss))
            cpu = read_cpu_seconds(self.kvlb.pid) - cpu0
            c = self.counts()
            late = sum(1 for r in self.records if r.lag_s > 0.1)
            print(f"[{t:6.1f}s] sent {c['sent']:6d}  ok {c['ok']:6d}  retryable-fail {c['retryable']:3d}  "
                  f"kill-broken {c['kill_broken']:3d}  other-fail {c['other']:3d}  in flight {self.in_flight:3d}  "
                  f"kills {len(self.kills):2d}  kvlb RSS {rss / 2**20:6.1f} MiB  kvlb CPU {cpu / max(t, 1e-9):5.1%}  "
                  f"sent >100ms late {late}", flush=True)
            n += 1

    async def run(self) -> int:
        args = self.args
        duration_s = args.minutes * 60.0
        await self.start_all()
        assert self.kvlb is not None
        print(f"kvlb (pid {self.kvlb.pid}) on 127.0.0.1:{self.kvlb_port}, policy {args.policy}, in front of "
              f"{args.replicas} simulated {PROFILE} replicas (time scale {TIME_SCALE}); {args.rate:g} requests/s "
              f"open-loop for {args.minutes:g} min, one replica killed (SIGKILL) and restarted every "
              f"{args.restart_every_s:g} s; logs in {self.workdir}", flush=True)
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            cpu0 = read_cpu_seconds(self.kvlb.pid)
            self.t0 = time.monotonic()
            sampler = asyncio.create_task(self.sample(cpu0))
            restarter = asyncio.create_task(self.restarts(duration_s))
            try:
                pending = await self.drive(http, duration_s)
                if pending:
                    await asyncio.wait(pending, timeout=CLIENT_TIMEOUT_S + 5)
                load_s = self.now()
                cpu = read_cpu_seconds(self.kvlb.pid) - cpu0
                end_rss = read_rss_bytes(self.kvlb.pid)
            finally:
                for task in (sampler, restarter):
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
        return self.report(load_s, cpu, end_rss)

    def report(self, load_s: float, cpu_s: float, end_rss: int) -> int:
        c = self.counts()
        unfinished = c["sent"] - c["ok"] - c["retryable"] - c["kill_broken"] - c["other"]
        baseline_t, baseline = next(((t, rss) for t, rss in self.rss if t >= RSS_BASELINE_AT_S - 1),
                                    self.rss[0] if self.rss else (load_s, end_rss))
        # A run shorter than the warm-up: the first sample stands in.
        growth = (end_rss - baseline) / baseline
        ok_lat = [r.ended_at - r.sent_at for r in self.records if r.done]
        stream_lat = [r.ended_at - r.sent_at for r in self.records if r.done and r.streaming]
        plain_lat = [r.ended_at - r.sent_at for r in self.records if r.done and not r.streaming]
        n = c["sent"]
        streamed = sum(r.streaming for r in self.records)
        failures = c["retryable"] + c["kill_broken"] + c["other"] + unfinished
        print()
        print(f"soak: {load_s:.0f} s of load, {n} requests ({n / load_s:.1f}/s; {streamed} streamed, "
              f"{n - streamed} not), {len(self.kills)} replica kills")
        for k in self.kills:
            back = f"healthy again after {k.back_after_s:.1f} s" if k.back_after_s is not None else "never back"
            print(f"  {k.at:6.1f}s  {k.replica} killed, {back}")
        print(f"requests:                         {n}")
        print(f"successes:                        {c['ok']}")
        print(f"failures:                         {failures}")
        print(f"  (a) retryable (before start):   {c['retryable']}   goal 0")
        print(f"  (b) stream broken by a kill:    {c['kill_broken']}   expected, SSE error event")
        print(f"  other failures:                 {c['other'] + unfinished}   goal 0"
              + (f" ({unfinished} unfinished)" if unfinished else ""))
        print(f"{f'kvlb RSS at {baseline_t:.0f} s:':<34}{baseline / 2**20:.1f} MiB")
        print(f"kvlb RSS at end:                  {end_rss / 2**20:.1f} MiB")
        print(f"kvlb RSS growth:                  {growth:+.1%}   goal < {RSS_GROWTH_GOAL:.0%}")
        print(f"kvlb CPU per request:             {cpu_s / max(n, 1) * 1e3:.3f} ms "
              f"({cpu_s:.1f} s CPU, {cpu_s / load_s:.1%} of a core)")
        print(f"latency p50 / p99 (successes):    {pct(ok_lat, .5) * 1e3:.1f} ms / {pct(ok_lat, .99) * 1e3:.1f} ms"
              f"  (streamed {pct(stream_lat, .5) * 1e3:.1f} / {pct(stream_lat, .99) * 1e3:.1f} ms, "
              f"not {pct(plain_lat, .5) * 1e3:.1f} / {pct(plain_lat, .99) * 1e3:.1f} ms)")
        late = [r.lag_s for r in self.records]
        print(f"send lag against schedule:        p99 {pct(late, .99) * 1e3:.1f} ms, max {max(late, default=0) * 1e3:.1f} ms")
        bad = [r for r in self.records if r.ended_at and self.classify(r) != "ok"]
        if bad:
            print("\nfailures (first 30):")
            for r in bad[:30]:
                print(f"  [{self.classify(r)}] sent {r.sent_at:.2f}s ended {r.ended_at:.2f}s "
                      f"{'stream' if r.streaming else 'plain'} status {r.status or '-'} replica {r.replica or '-'} "
                      f"({self.nearest_kill(r.ended_at)}): {r.error.strip()[:400]}")
        missed = []
        if c["retryable"]:
            missed.append(f"{c['retryable']} retryable failures")
        if c["other"] + unfinished:
            missed.append(f"{c['other'] + unfinished} other failures")
        if growth >= RSS_GROWTH_GOAL:
            missed.append(f"RSS growth {growth:.1%}")
        print("\nGOALS MISSED: " + "; ".join(missed) if missed else "\nall goals met")
        print(f"logs: {self.workdir}")
        return 1 if missed else 0


async def main(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="kvlb-soak-"))
    soak = Soak(args, workdir)
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        return await soak.run()
    finally:
        soak.stop_all()


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--rate", type=float, default=40.0, help="requests per second, open-loop")
    parser.add_argument("--restart-every-s", type=float, default=60.0, help="0 turns restarts off")
    parser.add_argument("--policy", default="cache_aware")
    parser.add_argument("--max-tokens", type=int, default=32,
                        help="largest max_tokens asked (8 up to this); longer answers make a kill "
                             "catch more streams mid-way")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    import uvloop

    try:
        sys.exit(uvloop.run(main(args)))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted; every process started was stopped", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    cli()
