"""Command lines for the engines `kvlb launch` starts: pure functions, no I/O.

Each replica gets its own HTTP port and its own KV event port. The engine binds its event
publisher on every interface (`tcp://*:PORT`) and kvlb connects to it, the engines' own rule.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

ENGINES = ("vllm", "sglang", "replica")
DEFAULT_BASE_PORT = 30000
# Below 32768 (the kernel's ephemeral range), so no outgoing connection already holds them.
DEFAULT_EVENTS_BASE_PORT = 31000
# A prefill engine's bootstrap server (SGLang's side channel for decode engines; vLLM's
# NIXL side channel, VLLM_NIXL_SIDE_CHANNEL_PORT), one per replica.
DEFAULT_BOOTSTRAP_BASE_PORT = 31500
VLLM_KV_TRANSFER_CONFIG = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
KV_EVENTS_TOPIC = "kv-events"
# vLLM's CPU backend only takes block sizes that are multiples of 32.
VLLM_CPU_BLOCK_MULTIPLE = 32
_WILDCARD_HOSTS = ("0.0.0.0", "::", "")


class LaunchError(ValueError):
    """Every problem with a launch request, one line each."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """What the user asked for; `build_launches` turns it into one command per replica."""

    engine: str
    model: str | None = None
    replicas: int = 1
    gpus_per_replica: int = 1
    cpu: bool = False
    block_size: int | None = None  # None: the engine's default (see `default_block_size`)
    host: str = "127.0.0.1"
    base_port: int = DEFAULT_BASE_PORT
    events_base_port: int = DEFAULT_EVENTS_BASE_PORT
    kvlb_port: int = 8000  # only checked against the engines' ports
    python: str = "python"
    engine_args: tuple[str, ...] = ()
    cpu_count: int = 1  # the host's, for --cpu's one core per replica; passed in to stay pure
    # Prefill/decode disaggregation: the first `prefill` replicas prefill, the rest decode
    # (0: every replica serves whole requests).
    prefill: int = 0
    bootstrap_base_port: int = DEFAULT_BOOTSTRAP_BASE_PORT

    def role(self, i: int) -> str:
        return "both" if not self.prefill else "prefill" if i < self.prefill else "decode"

    @property
    def effective_block_size(self) -> int:
        return self.block_size if self.block_size is not None else default_block_size(self.engine, self.cpu)


@dataclass(frozen=True, slots=True)
class EngineLaunch:
    """One replica: how to start it and where kvlb finds it."""

    index: int
    argv: tuple[str, ...]
    port: int
    events_port: int
    url: str  # what kvlb forwards to and health-checks
    events_endpoint: str  # what kvlb connects to for this replica's KV events
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))  # added to os.environ
    role: str = "both"
    bootstrap_port: int | None = None  # a prefill engine's side channel


def default_block_size(engine: str, cpu: bool) -> int:
    return 128 if engine == "vllm" and cpu else 16


def connect_host(host: str) -> str:
    """The address a local client uses for a server bound to `host` (wildcards mean loopback)."""
    if host in _WILDCARD_HOSTS:
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def kv_events_config(events_port: int) -> str:
    """The `--kv-events-config` JSON vLLM and SGLang both read."""
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{events_port}",
            "topic": KV_EVENTS_TOPIC,
        }
    )


def validate(spec: LaunchSpec) -> None:
    """Raise LaunchError listing every problem, so one run shows them all."""
    problems: list[str] = []
    if spec.engine not in ENGINES:
        problems.append(f"--engine must be one of {', '.join(ENGINES)}, got {spec.engine!r}")
    if spec.engine in ("vllm", "sglang") and not spec.model:
        problems.append(f"--model is required with --engine {spec.engine}")
    if spec.replicas < 1:
        problems.append(f"--replicas must be >= 1, got {spec.replicas}")
    if spec.gpus_per_replica < 1:
        problems.append(f"--gpus-per-replica must be >= 1, got {spec.gpus_per_replica}")
    if spec.block_size is not None and spec.block_size < 1:
        problems.append(f"--block-size must be >= 1, got {spec.block_size}")
    if spec.prefill and not 0 < spec.prefill < spec.replicas:
        problems.append(f"--prefill must leave at least one decode replica: 1..{spec.replicas - 1}, "
                        f"got {spec.prefill}")
    if spec.cpu_count < 1:
        problems.append(f"cpu count must be >= 1, got {spec.cpu_count}")
    if spec.cpu and spec.engine == "sglang":
        problems.append("--cpu does not work with --engine sglang: SGLang needs CUDA")
    if spec.cpu and spec.engine == "vllm":
        if spec.gpus_per_replica > 1:
            problems.append("--gpus-per-replica does not apply with --cpu (one core per replica)")
        if spec.effective_block_size % VLLM_CPU_BLOCK_MULTIPLE:
            problems.append(
                f"--block-size must be a multiple of {VLLM_CPU_BLOCK_MULTIPLE} for vLLM on CPU, "
                f"got {spec.effective_block_size}"
            )
    problems.extend(_port_problems(spec))
    if problems:
        raise LaunchError(problems)


def _port_problems(spec: LaunchSpec) -> list[str]:
    n = max(spec.replicas, 1)
    ranges = {
        "--base-port": range(spec.base_port, spec.base_port + n),
        "--events-base-port": range(spec.events_base_port, spec.events_base_port + n),
        "--port": range(spec.kvlb_port, spec.kvlb_port + 1),
    }
    if spec.prefill:
        ranges["--bootstrap-base-port"] = range(spec.bootstrap_base_port, spec.bootstrap_base_port + n)
    problems = [
        f"{flag} gives ports {_span(ports)}, outside 1-65535"
        for flag, ports in ranges.items()
        if ports.start < 1 or ports.stop - 1 > 65535
    ]
    names = list(ranges)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if ranges[a].start < ranges[b].stop and ranges[b].start < ranges[a].stop:
                problems.append(
                    f"{a} ports {_span(ranges[a])} overlap {b} ports {_span(ranges[b])}"
                )
    return problems


def _span(ports: range) -> str:
    return str(ports.start) if len(ports) == 1 else f"{ports.start}-{ports.stop - 1}"


def build_launches(spec: LaunchSpec) -> list[EngineLaunch]:
    """One EngineLaunch per replica; raises LaunchError for a spec that cannot run."""
    validate(spec)
    builder = {"vllm": _vllm, "sglang": _sglang, "replica": _replica}[spec.engine]
    launches = []
    host = connect_host(spec.host)
    for i in range(spec.replicas):
        port, events_port = spec.base_port + i, spec.events_base_port + i
        argv, env = builder(spec, i, port, events_port)
        role = spec.role(i)
        bootstrap = spec.bootstrap_base_port + i if role != "both" else None
        argv += _disaggregation_args(spec, role, bootstrap)
        if bootstrap is not None and spec.engine == "vllm":
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(bootstrap)
        launches.append(
            EngineLaunch(
                index=i,
                argv=tuple(argv),
                env=MappingProxyType(env),
                port=port,
                events_port=events_port,
                url=f"http://{host}:{port}",
                events_endpoint=f"tcp://{host}:{events_port}",
                role=role,
                bootstrap_port=bootstrap if role == "prefill" else None,
            )
        )
    return launches


def _disaggregation_args(spec: LaunchSpec, role: str, bootstrap: int | None) -> list[str]:
    """The engine flags of its half: SGLang's mode and bootstrap port (the simulated replica
    takes the same), or vLLM's connector, with which every engine serves either half."""
    if role == "both" or bootstrap is None:
        return []
    if spec.engine == "vllm":
        return ["--kv-transfer-config", VLLM_KV_TRANSFER_CONFIG]
    args = ["--disaggregation-mode", role]
    if role == "prefill":
        args += ["--disaggregation-bootstrap-port", str(bootstrap)]
    return args


def _gpu_ids(spec: LaunchSpec, i: int) -> str:
    k = spec.gpus_per_replica
    return ",".join(str(d) for d in range(i * k, i * k + k))


def _vllm(spec: LaunchSpec, i: int, port: int, events_port: int) -> tuple[list[str], dict[str, str]]:
    # `python -m` rather than the `vllm` console script, which is broken in the CPU build.
    argv = [
        spec.python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(spec.model),
        "--host", spec.host,
        "--port", str(port),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",  # usage.cached_tokens, which kvlb's bookkeeping reads
        "--block-size", str(spec.effective_block_size),
        "--kv-events-config", kv_events_config(events_port),
    ]  # fmt: skip
    if spec.gpus_per_replica > 1:
        argv += ["--tensor-parallel-size", str(spec.gpus_per_replica)]
    env = {"HF_HUB_OFFLINE": "1"}
    if spec.cpu:
        # One core each, so replicas on one host do not fight over the same cores.
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(i % spec.cpu_count)
        env["VLLM_HOST_IP"] = "127.0.0.1"
    else:
        env["CUDA_VISIBLE_DEVICES"] = _gpu_ids(spec, i)
    return argv + list(spec.engine_args), env


def _sglang(spec: LaunchSpec, i: int, port: int, events_port: int) -> tuple[list[str], dict[str, str]]:
    argv = [
        spec.python, "-m", "sglang.launch_server",
        "--model-path", str(spec.model),
        "--host", spec.host,
        "--port", str(port),
        "--page-size", str(spec.effective_block_size),
        "--kv-events-config", kv_events_config(events_port),
    ]  # fmt: skip
    if spec.gpus_per_replica > 1:
        argv += ["--tp-size", str(spec.gpus_per_replica)]
    env = {"HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": _gpu_ids(spec, i)}
    return argv + list(spec.engine_args), env


def _replica(spec: LaunchSpec, i: int, port: int, events_port: int) -> tuple[list[str], dict[str, str]]:
    argv = [
        spec.python, "-m", "balancer", "replica",
        "--port", str(port),
        "--host", spec.host,
        "--block-size", str(spec.effective_block_size),
        "--kv-events-endpoint", f"tcp://*:{events_port}",
    ]  # fmt: skip
    if spec.model:
        argv += ["--model", spec.model]
    return argv + list(spec.engine_args), {}
