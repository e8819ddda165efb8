"""The `kvlb` command. Test-bed subcommands (replica, loadtest, ...) arrive through the
`kvlb.commands` entry-point group, so the proxy installs and runs without them."""

from __future__ import annotations

import argparse
import logging
import sys
from importlib.metadata import entry_points

from balancer.config import (
    ConfigError,
    Settings,
    check_config_main,
    load_settings,
    settings_from_args,
)
from balancer.logs import configure_logging
from balancer.process.launch import register as register_launch
from balancer.protocol import kvlb_version

log = logging.getLogger("kvlb")
ENTRY_POINT_GROUP = "kvlb.commands"


def _serve_settings(args: argparse.Namespace) -> Settings:
    if args.config and args.replica:
        raise ConfigError(["give either --config or --replica, not both"])
    if args.config:
        settings = load_settings(args.config)
        if args.host is not None or args.port is not None or args.policy is not None:
            raise ConfigError(["--host, --port and --policy go with --replica; with --config, set them in the file"])
        return settings
    if not args.replica:
        raise ConfigError(["give --config FILE or at least one --replica URL"])
    return settings_from_args(
        args.replica,
        policy=args.policy or "predictive",
        host=args.host or "127.0.0.1",
        port=args.port if args.port is not None else 8000,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        settings = _serve_settings(args)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"kvlb: {problem}", file=sys.stderr)
        return 2
    configure_logging(settings.logging.level, settings.logging.format)
    if args.workers < 1:
        print("kvlb: --workers must be at least 1", file=sys.stderr)
        return 2
    if args.workers > 1:
        from balancer.process.workers import supervise

        if settings.sync.redis_url is None:
            log.warning("%d workers without sync.redis_url: each routes on its own state", args.workers)
        return supervise(args.workers, _worker_argv(), settings.listen.port)
    import uvloop

    from balancer.process.serve import serve_until_stopped

    try:
        uvloop.run(serve_until_stopped(settings, args.config, reuse_port=args.reuse_port))
    except ConfigError as exc:  # found at start: key files, environment variables
        for problem in exc.problems:
            print(f"kvlb: {problem}", file=sys.stderr)
        return 2
    return 0


def _worker_argv() -> list[str]:
    """This command line as one worker runs it: same arguments, one process, shared port."""
    argv, skip = [], False
    for arg in sys.argv[1:]:
        if skip:
            skip = False
            continue
        if arg == "--workers":
            skip = True
            continue
        if arg.startswith("--workers="):
            continue
        argv.append(arg)
    return [sys.executable, "-m", "balancer", *argv, "--reuse-port"]


def cmd_check_config(args: argparse.Namespace) -> int:
    return check_config_main(args.file)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvlb", description="KV-cache-aware load balancer for LLM inference")
    parser.add_argument("--version", action="version", version=f"kvlb {kvlb_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the balancer")
    serve.add_argument("--config", metavar="FILE", help="YAML configuration (see config/balancer.yaml)")
    serve.add_argument("--replica", metavar="URL", action="append", help="replica base URL; repeat for more")
    serve.add_argument("--policy", help="policy name for --replica mode (default predictive)")
    serve.add_argument("--host", help="listen address for --replica mode (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="listen port for --replica mode (default 8000)")
    serve.add_argument(
        "--workers", type=int, default=1,
        help="processes sharing the listening port (SO_REUSEPORT); set sync.redis_url so they share routing state",
    )  # fmt: skip
    serve.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)
    serve.set_defaults(func=cmd_serve)

    check = sub.add_parser("check-config", help="validate a configuration file and print every problem")
    check.add_argument("file")
    check.set_defaults(func=cmd_check_config)

    register_launch(sub)

    for entry in entry_points(group=ENTRY_POINT_GROUP):
        try:
            register = entry.load()
        except ModuleNotFoundError as exc:
            # The proxy-only image installs kvlb without its test bed: those commands are absent.
            if exc.name is None or exc.name.split(".")[0] != entry.module.split(".")[0]:
                raise
            continue
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
