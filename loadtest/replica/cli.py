"""`kvlb replica`: run one simulated GPU replica (also `python -m loadtest.replica`).

`register` is the `kvlb.commands` entry point that `balancer/process/cli.py` discovers, so the proxy
package never imports the test bed.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import Any

from loadtest.replica.config import (
    DEFAULT_BOOTSTRAP_PORT,
    DISAGGREGATION_MODES,
    KvTransferConfig,
    ReplicaConfig,
)
from loadtest.replica.faults import Faults
from loadtest.replica.kv_events import (
    DEFAULT_TOPIC,
    ENCODINGS,
    KvEventsUnavailable,
    require_packages,
)
from loadtest.replica.lora import parse_lora_module
from loadtest.replica.profiles import DEFAULT_PROFILE, PROFILES

HELP = "run a simulated GPU replica (vLLM/SGLang-compatible HTTP API)"
# vLLM's switch for the load/unload adapter routes; read as vLLM reads it.
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, required=True, help="0 picks a free port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES))
    parser.add_argument("--model", default=None, help="served model name")
    parser.add_argument(
        "--kv-capacity-tokens", type=int, default=None,
        help="KV cache size in tokens (default: the profile's calibrated capacity)",
    )  # fmt: skip
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-running", type=int, default=256)
    parser.add_argument("--max-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-waiting", type=int, default=4096, help="queue bound; 503 beyond")
    parser.add_argument("--context-limit", type=int, default=131072)
    parser.add_argument("--default-max-tokens", type=int, default=16)
    parser.add_argument(
        "--time-scale", type=float, default=1.0,
        help="run this many times faster than the model; /get_server_info reports it",
    )  # fmt: skip
    parser.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024)
    events = parser.add_argument_group("KV cache events (ZMQ, as vLLM's --kv-events-config)")
    events.add_argument(
        "--kv-events-endpoint", default=None, metavar="ENDPOINT",
        help="publish KV events here; tcp://*:PORT binds, tcp://HOST:PORT connects (default: off)",
    )  # fmt: skip
    events.add_argument("--kv-events-topic", default=DEFAULT_TOPIC)
    events.add_argument("--kv-events-encoding", default="map", choices=ENCODINGS)
    lora = parser.add_argument_group("LoRA adapters (vLLM's flags)")
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    lora.add_argument(
        "--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
        help='adapters to register at start: NAME=PATH or {"name": ..., "path": ..., '
        '"base_model_name": ...}',
    )  # fmt: skip
    lora.add_argument(
        "--max-loras", type=int, default=1, help="adapters resident in GPU slots at once"
    )
    lora.add_argument(
        "--max-loaded-loras", type=int, default=None,
        help="SGLang's: adapters registered at once; a load beyond is refused until one is "
        "unloaded (default: no limit)",
    )  # fmt: skip
    lora.add_argument(
        "--lora-load-ms", type=float, default=20.0,
        help="model milliseconds to load an adapter into a slot",
    )  # fmt: skip
    lora.add_argument(
        "--lora-register-ms", type=float, default=0.0,
        help="model milliseconds a load request takes to read the adapter from disk before it "
        "is registered; loads run one at a time (default 0)",
    )  # fmt: skip
    lora.add_argument(
        "--allow-runtime-lora-updating", action="store_true",
        help=f"mount /v1/load_lora_adapter and /v1/unload_lora_adapter (also {RUNTIME_LORA_ENV}=True)",
    )  # fmt: skip
    disagg = parser.add_argument_group(
        "prefill/decode disaggregation (SGLang's flags, or vLLM's --kv-transfer-config)"
    )
    disagg.add_argument(
        "--disaggregation-mode", default="null", choices=DISAGGREGATION_MODES,
        help="prefill or decode half of SGLang's protocol (default null: whole requests)",
    )  # fmt: skip
    disagg.add_argument(
        "--disaggregation-bootstrap-port", type=int, default=DEFAULT_BOOTSTRAP_PORT,
        help="a prefill replica's side channel for decode replicas; 0 picks a free port",
    )  # fmt: skip
    disagg.add_argument(
        "--disaggregation-wait-s", type=float, default=30.0,
        help="real seconds a decode replica waits for the prefill side before a 503",
    )  # fmt: skip
    disagg.add_argument(
        "--kv-transfer-config", default=None, metavar="JSON",
        help='vLLM\'s, e.g. \'{"kv_connector":"NixlConnector","kv_role":"kv_both"}\': '
        "both roles of vLLM's connector flow on this server",
    )  # fmt: skip
    disagg.add_argument(
        "--kv-transfer-gbps", type=float, default=100.0,
        help="prefill-to-decode link bandwidth in gigabits per second, for the transfer time",
    )  # fmt: skip
    disagg.add_argument(
        "--kv-transfer-ttl-s", type=float, default=60.0,
        help="model seconds a prefill replica holds KV no decode replica has fetched",
    )  # fmt: skip
    faults = parser.add_argument_group("fault injection (also POST /admin/fault)")
    faults.add_argument("--fault-error-rate", type=float, default=0.0, help="fraction answered 503")
    faults.add_argument(
        "--fault-hang-s", type=float, default=None, help="hang before the first byte"
    )
    faults.add_argument("--fault-cut-after-tokens", type=int, default=None)
    faults.add_argument("--fault-unhealthy", action="store_true", help="/health answers 503")
    faults.add_argument(
        "--fault-exit-after-s", type=float, default=None, help="exit(1) after S seconds"
    )
    parser.add_argument("--log-level", default="WARNING")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("replica", help=HELP, description=HELP)
    add_arguments(parser)
    parser.set_defaults(func=main)


def config_from_args(args: argparse.Namespace) -> ReplicaConfig:
    faults = Faults.from_json(
        {
            "error_rate": args.fault_error_rate,
            "hang_s": args.fault_hang_s,
            "cut_after_tokens": args.fault_cut_after_tokens,
            "unhealthy": args.fault_unhealthy,
            "exit_after_s": args.fault_exit_after_s,
        }
    )
    return ReplicaConfig(
        profile=args.profile,
        host=args.host,
        port=args.port,
        model=args.model,
        kv_capacity_tokens=args.kv_capacity_tokens,
        block_size=args.block_size,
        max_running=args.max_running,
        max_batched_tokens=args.max_batched_tokens,
        max_waiting=args.max_waiting,
        context_limit=args.context_limit,
        default_max_tokens=args.default_max_tokens,
        time_scale=args.time_scale,
        max_body_bytes=args.max_body_bytes,
        faults=faults,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_topic=args.kv_events_topic,
        kv_events_encoding=args.kv_events_encoding,
        enable_lora=args.enable_lora,
        lora_modules=tuple(parse_lora_module(entry) for entry in args.lora_modules),
        max_loras=args.max_loras,
        lora_load_ms=args.lora_load_ms,
        max_loaded_loras=args.max_loaded_loras,
        lora_register_ms=args.lora_register_ms,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating
        or runtime_lora_updating_from_env(),
        disaggregation_mode=args.disaggregation_mode,
        disaggregation_bootstrap_port=args.disaggregation_bootstrap_port,
        disaggregation_wait_s=args.disaggregation_wait_s,
        kv_transfer_config=KvTransferConfig.parse(args.kv_transfer_config)
        if args.kv_transfer_config is not None
        else None,
        kv_transfer_gbps=args.kv_transfer_gbps,
        kv_transfer_ttl_s=args.kv_transfer_ttl_s,
    )


def runtime_lora_updating_from_env() -> bool:
    return os.environ.get(RUNTIME_LORA_ENV, "0").strip().lower() in ("1", "true")


async def serve(config: ReplicaConfig) -> None:
    from loadtest.replica.server import ReplicaServer

    server = ReplicaServer(config)
    port = await server.start()
    # Tests and scripts starting `--port 0` read the real port from this line, and a prefill
    # replica's bootstrap port (one line: launchers stop reading at it).
    line = f"kvlb replica listening on http://{config.host}:{port}"
    if server.bootstrap_port is not None:
        line += f" (bootstrap port {server.bootstrap_port})"
    print(line, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
    finally:
        await server.stop()


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        config = config_from_args(args)
    except ValueError as error:
        print(f"kvlb replica: {error}", file=sys.stderr)
        return 2
    if config.kv_events_endpoint is not None:
        try:
            require_packages()
        except KvEventsUnavailable as error:
            print(f"kvlb replica: {error}", file=sys.stderr)
            return 2
    import uvloop

    try:
        uvloop.run(serve(config))
    except OSError as error:  # e.g. the port is taken
        print(f"kvlb replica: {error}", file=sys.stderr)
        return 1
    return 0


def run(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.replica", description=HELP)
    add_arguments(parser)
    return main(parser.parse_args(argv))
