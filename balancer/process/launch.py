"""`kvlb launch`: start N engines, wait until each answers /health, then serve kvlb in front
of them with a generated configuration. SIGINT or SIGTERM stops kvlb, then every engine.

Engines run in sessions of their own, so a Ctrl-C in the terminal reaches the launcher alone
and the launcher decides the order: kvlb first (it stops taking requests), engines after.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from balancer.config import ConfigError, Settings, parse_settings
from balancer.process.children import dies_with_parent
from balancer.process.engine_args import (
    DEFAULT_BASE_PORT,
    DEFAULT_BOOTSTRAP_BASE_PORT,
    DEFAULT_EVENTS_BASE_PORT,
    ENGINES,
    EngineLaunch,
    LaunchError,
    LaunchSpec,
    build_launches,
)

HELP = "start N engines (vLLM, SGLang or simulated) and serve kvlb in front of them"
HEALTH_POLL_S = 0.5
HEALTH_TIMEOUT_S = 2.0
STOP_GRACE_S = 10.0
LOG_TAIL_LINES = 30
CONFIG_MARKER = "# kvlb configuration"


def register(sub: Any) -> None:
    parser = sub.add_parser("launch", help=HELP, description=HELP)
    parser.add_argument("--engine", required=True, choices=ENGINES)
    parser.add_argument("--model", help="model path (required for vllm and sglang); served name for replica")
    parser.add_argument("--replicas", type=int, required=True, metavar="N")
    parser.add_argument("--gpus-per-replica", type=int, default=1, metavar="K",
                        help="tensor parallelism; replica i gets devices i*K .. i*K+K-1")
    parser.add_argument("--cpu", action="store_true", help="vLLM's CPU backend: one core per replica")
    parser.add_argument("--block-size", type=int, metavar="B",
                        help="KV block size in tokens (default 16; 128 for vLLM with --cpu)")
    parser.add_argument("--base-port", type=int, default=DEFAULT_BASE_PORT, metavar="P",
                        help="engine i listens on P+i")
    parser.add_argument("--events-base-port", type=int, default=DEFAULT_EVENTS_BASE_PORT, metavar="E",
                        help="engine i publishes KV events on E+i")
    parser.add_argument("--prefill", type=int, default=0, metavar="N",
                        help="prefill/decode disaggregation: the first N replicas prefill, the rest decode "
                             "(SGLang's protocol for sglang and replica, vLLM's NIXL connector for vllm)")
    parser.add_argument("--bootstrap-base-port", type=int, default=DEFAULT_BOOTSTRAP_BASE_PORT, metavar="B",
                        help="with --prefill: engine i's KV side channel listens on B+i")
    parser.add_argument("--host", default="127.0.0.1", help="where kvlb and the engines listen")
    parser.add_argument("--port", type=int, default=8000, help="kvlb's port")
    parser.add_argument("--policy", default="predictive")
    parser.add_argument("--engine-python", default=sys.executable, metavar="PYTHON",
                        help="the Python that has the engine installed (default: this one)")
    parser.add_argument("--log-dir", metavar="DIR", help="engine logs (default: a fresh temporary folder)")
    parser.add_argument("--start-timeout-s", type=float, default=600.0,
                        help="how long every engine has to answer /health")
    parser.add_argument("--write-config", metavar="FILE",
                        help="write the generated kvlb YAML here (SIGHUP then reloads it)")
    parser.add_argument("--print-commands", action="store_true",
                        help="print the engine commands and the kvlb YAML; start nothing")
    parser.add_argument("engine_args", nargs=argparse.REMAINDER, metavar="-- ENGINE ARGS",
                        help="passed to every engine verbatim")
    parser.set_defaults(func=cmd_launch)


def spec_from_args(args: argparse.Namespace) -> LaunchSpec:
    engine_args = list(args.engine_args)
    if engine_args[:1] == ["--"]:  # argparse keeps the separator in a REMAINDER
        engine_args = engine_args[1:]
    return LaunchSpec(
        engine=args.engine,
        model=args.model,
        replicas=args.replicas,
        gpus_per_replica=args.gpus_per_replica,
        cpu=args.cpu,
        block_size=args.block_size,
        host=args.host,
        base_port=args.base_port,
        events_base_port=args.events_base_port,
        kvlb_port=args.port,
        python=args.engine_python,
        engine_args=tuple(engine_args),
        cpu_count=os.cpu_count() or 1,
        prefill=args.prefill,
        bootstrap_base_port=args.bootstrap_base_port,
    )


def tokenizer_dir(model: str | None) -> str | None:
    """The model directory when it holds tokenizer.json; otherwise kvlb asks the engines'
    /tokenize, so that prompts are still split into the blocks the engines hash."""
    if model and os.path.isfile(os.path.join(model, "tokenizer.json")):
        return os.path.abspath(model)
    return None


def settings_data(
    spec: LaunchSpec, launches: list[EngineLaunch], policy: str, tokenizer: str | None
) -> dict[str, Any]:
    """kvlb's configuration for these engines, as the YAML a user would write."""
    kv_events: dict[str, Any] = {"enabled": True, "block_size": spec.effective_block_size}
    if tokenizer is not None:
        kv_events["tokenizer"] = tokenizer
    replicas: list[dict[str, Any]] = []
    for e in launches:
        entry: dict[str, Any] = {"url": e.url, "kv_events_endpoint": e.events_endpoint}
        if e.role != "both":
            entry["role"] = e.role
        if e.bootstrap_port is not None:
            entry["bootstrap_port"] = e.bootstrap_port
        replicas.append(entry)
    data = {
        "listen": {"host": spec.host, "port": spec.kvlb_port},
        "replicas": replicas,
        "policy": {"name": policy},
        "kv_events": kv_events,
    }
    if spec.prefill:
        data["disaggregation"] = {"protocol": "vllm" if spec.engine == "vllm" else "sglang"}
    return data


def shell_line(launch: EngineLaunch) -> str:
    """The command as one pasteable shell line, environment additions first."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in launch.env.items())
    return f"{env} {shlex.join(launch.argv)}" if env else shlex.join(launch.argv)


def _problems(lines: list[str]) -> int:
    for line in lines:
        print(f"kvlb launch: {line}", file=sys.stderr)
    return 2


def cmd_launch(args: argparse.Namespace) -> int:
    import yaml

    try:
        spec = spec_from_args(args)
        launches = build_launches(spec)
        data = settings_data(spec, launches, args.policy, tokenizer_dir(spec.model))
        settings = parse_settings(data)
    except (LaunchError, ConfigError) as exc:
        return _problems(exc.problems)
    config_text = yaml.safe_dump(data, sort_keys=False)
    if args.write_config:
        try:
            Path(args.write_config).write_text(config_text)
        except OSError as exc:
            return _problems([f"cannot write {args.write_config}: {exc.strerror}"])
    if args.print_commands:
        for launch in launches:
            print(f"# engine {launch.index}: {launch.url}, KV events at {launch.events_endpoint}")
            print(shell_line(launch))
        print(f"{CONFIG_MARKER} (kvlb serve --config FILE)")
        print(config_text, end="", flush=True)
        return 0
    busy = _busy_ports(spec)
    if busy:
        return _problems(busy)

    from balancer.logs import configure_logging

    configure_logging(settings.logging.level, settings.logging.format)
    try:
        log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="kvlb-launch-"))
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return _problems([f"cannot create the log folder: {exc}"])
    print(f"kvlb launch: engine logs in {log_dir}", flush=True)
    import uvloop

    return uvloop.run(_run(launches, settings, log_dir, args.start_timeout_s, args.write_config))


def _busy_ports(spec: LaunchSpec) -> list[str]:
    """Ports something already holds. Checked before starting anything: an old engine still
    on a port would answer /health for a new one that is about to fail."""
    wanted = [(spec.host, spec.kvlb_port)]
    for i in range(spec.replicas):
        # Engines bind their event publishers on every interface.
        wanted += [(spec.host, spec.base_port + i), ("0.0.0.0", spec.events_base_port + i)]
        if spec.role(i) != "both":
            wanted.append((spec.host, spec.bootstrap_base_port + i))
    problems = []
    for host, port in wanted:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            # As servers bind: a port with connections only in TIME_WAIT counts as free.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as exc:
                problems.append(f"cannot use port {port} on {host}: {exc.strerror}")
    return problems


# --- engine processes -------------------------------------------------------------------------


@dataclass
class Engine:
    launch: EngineLaunch
    proc: subprocess.Popen[bytes]
    log_path: Path
    healthy: bool = False
    reported_exit: bool = field(default=False, repr=False)

    @property
    def name(self) -> str:
        return f"engine {self.launch.index} (pid {self.proc.pid})"

    def signal_group(self, sig: int) -> None:
        # The engine leads its own session; its workers (tensor parallel ranks) are in it too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def group_alive(self) -> bool:
        self.proc.poll()  # reap the leader first: its zombie would still count as a member
        try:
            os.killpg(self.proc.pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True


def start_engine(launch: EngineLaunch, log_dir: Path) -> Engine:
    log_path = log_dir / f"engine-{launch.index}.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            list(launch.argv),
            env={**os.environ, **launch.env},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=dies_with_parent(),  # a launcher killed outright still stops its engines
        )
    return Engine(launch, proc, log_path)


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return [line.rstrip("\n") for line in deque(f, maxlen=lines)]
    except OSError as exc:
        return [f"(cannot read {path}: {exc.strerror})"]


def _report_failure(engine: Engine, why: str) -> None:
    print(f"kvlb launch: {engine.name} {why}; last {LOG_TAIL_LINES} lines of {engine.log_path}:",
          file=sys.stderr)
    for line in log_tail(engine.log_path):
        print(f"    {line}", file=sys.stderr)
    sys.stderr.flush()


async def wait_until_healthy(engines: list[Engine], timeout_s: float, interrupted: asyncio.Event) -> bool:
    """True once every engine answers GET /health with 200. False, after printing which
    engine failed and its log tail, when one exits or the deadline passes first (or on a
    signal, without a report)."""
    import aiohttp

    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = started + timeout_s
    timeout = aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)

    async def answers(http: aiohttp.ClientSession, engine: Engine) -> bool:
        try:
            async with http.get(engine.launch.url + "/health") as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    async with aiohttp.ClientSession(timeout=timeout) as http:
        while not interrupted.is_set():
            waiting = [e for e in engines if not e.healthy]
            for engine in waiting:
                # Checked before /health: another server on the port must not pass for it.
                code = engine.proc.poll()
                if code is not None:
                    _report_failure(engine, f"exited with status {code} before it was healthy")
                    return False
            for engine, ok in zip(waiting, await asyncio.gather(*(answers(http, e) for e in waiting)),
                                  strict=True):
                if ok and engine.proc.poll() is None:
                    engine.healthy = True
                    print(f"kvlb launch: {engine.name} healthy after {loop.time() - started:.1f} s",
                          flush=True)
            if all(e.healthy for e in engines):
                return True
            if loop.time() >= deadline:
                for engine in engines:
                    if not engine.healthy:
                        _report_failure(engine, f"did not answer /health within {timeout_s:g} s")
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(interrupted.wait(), HEALTH_POLL_S)
    return False


async def watch_engines(engines: list[Engine], interval_s: float = 1.0) -> None:
    """Say so when an engine dies while kvlb serves; kvlb's health checks route around it."""
    import logging

    log = logging.getLogger("kvlb.launch")
    while True:
        for engine in engines:
            code = engine.proc.poll()
            if code is not None and not engine.reported_exit:
                engine.reported_exit = True
                log.error("%s exited with status %s while serving; see %s", engine.name, code, engine.log_path)
        await asyncio.sleep(interval_s)


async def stop_engines(engines: list[Engine], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every engine's session, SIGKILL what is left after `grace_s` (or at once on
    another SIGINT/SIGTERM), and wait for them."""
    loop = asyncio.get_running_loop()
    hurry = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, hurry.set)
    for engine in engines:
        engine.signal_group(signal.SIGTERM)
    deadline = loop.time() + grace_s
    while any(e.group_alive() for e in engines) and loop.time() < deadline and not hurry.is_set():
        await asyncio.sleep(0.1)
    for engine in engines:
        if engine.group_alive():
            print(f"kvlb launch: {engine.name} still running; killing it", file=sys.stderr, flush=True)
            engine.signal_group(signal.SIGKILL)
    # SIGKILL cannot be refused, but a process stuck in the kernel (a GPU driver call, say)
    # dies only when it returns: wait, within bounds.
    deadline = loop.time() + grace_s
    while any(e.group_alive() for e in engines) and loop.time() < deadline:
        await asyncio.sleep(0.1)
    for engine in engines:
        if engine.group_alive():
            print(f"kvlb launch: {engine.name} survived SIGKILL", file=sys.stderr, flush=True)


async def _run(
    launches: list[EngineLaunch], settings: Settings, log_dir: Path, start_timeout_s: float,
    config_path: str | None,
) -> int:
    from balancer.process.serve import serve_until_stopped

    loop = asyncio.get_running_loop()
    interrupted = asyncio.Event()
    received: list[int] = []

    def on_signal(sig: int) -> None:
        received.append(sig)
        interrupted.set()

    # Installed before the first engine starts, so a Ctrl-C never skips the cleanup below.
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    engines: list[Engine] = []
    watcher: asyncio.Task[None] | None = None
    try:
        for launch in launches:
            try:
                engine = start_engine(launch, log_dir)
            except OSError as exc:  # the engine's Python is missing, say
                print(f"kvlb launch: cannot start engine {launch.index}: {exc}\n    {shell_line(launch)}",
                      file=sys.stderr, flush=True)
                return 1
            engines.append(engine)
            print(f"kvlb launch: {engine.name}: {shell_line(launch)}", flush=True)
        if not await wait_until_healthy(engines, start_timeout_s, interrupted):
            if received:
                print("kvlb launch: interrupted while the engines started", file=sys.stderr, flush=True)
                return 128 + received[0]
            return 1
        watcher = loop.create_task(watch_engines(engines))

        def listening(running: Any) -> None:
            print(f"kvlb launch: kvlb serving on http://{settings.listen.host}:{running.port}", flush=True)
            if interrupted.is_set():
                # A signal that came between the engines' start and kvlb's own handlers: pass
                # it on to them now rather than lose it.
                signal.raise_signal(received[-1])

        try:
            await serve_until_stopped(settings, config_path, on_listening=listening)
        except ConfigError as exc:  # found at start: key files, environment variables
            return _problems(exc.problems)
        except OSError as exc:
            return _problems([f"kvlb cannot listen on {settings.listen.host}:{settings.listen.port}: {exc}"])
        return 0
    finally:
        if watcher is not None:
            watcher.cancel()
        if engines:
            print("kvlb launch: stopping the engines", file=sys.stderr, flush=True)
            await stop_engines(engines)
