"""One balancer process serving until a signal stops it."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from collections.abc import Callable

from balancer.app import RunningBalancer, start_balancer
from balancer.config import ConfigError, Settings
from balancer.ops.reload import reload_file

log = logging.getLogger("kvlb")


async def serve_until_stopped(
    settings: Settings,
    config_path: str | None,
    reuse_port: bool = False,
    on_listening: Callable[[RunningBalancer], None] | None = None,
) -> None:
    """Serve until SIGINT or SIGTERM, then drain and close; SIGHUP reloads `config_path`.
    `kvlb serve` and `kvlb launch` share it, so both stop and reload the same way."""
    running = await start_balancer(settings, reuse_port=reuse_port)
    running.balancer.config_path = config_path
    # What start-up built (modules, classes, the configuration) lives as long as the process:
    # out of the collector's sight, every full pass walks only what traffic made.
    gc.freeze()
    log.info(
        "kvlb listening on http://%s:%d with %d replica(s), policy %s",
        settings.listen.host, running.port, len(settings.replicas), settings.policy.name,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    def on_sighup() -> None:
        if config_path is None:
            log.warning("SIGHUP ignored: started without --config, so there is no file to reload")
            return
        try:
            reload_file(running.balancer, config_path)
        except ConfigError as exc:
            log.error("reload rejected, the running configuration stays:\n%s", exc)

    loop.add_signal_handler(signal.SIGHUP, on_sighup)
    try:
        if on_listening is not None:  # after the handlers: a signal from now on stops kvlb
            on_listening(running)
        await stop.wait()
    finally:
        log.info("kvlb shutting down")
        await running.close()
