"""Real processes on 127.0.0.1: simulated replicas, and kvlb (or another router) in front.

Used by `make demo`, `kvlb compare --live` and the live-against-offline agreement test. Every
process is started in its own session and dies with its starter, and `stop` is safe to call
twice, so nothing outlives a failed run.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from loadtest.procs import free_port, start_process, stop_process, tree_cpu_seconds, wait_for_http
from loadtest.simulator.cli import HARNESS_LIMITS

MODEL = "sim-model"


def replica_command(port: int, profile: str, time_scale: float, model: str = MODEL, extra: Sequence[str] = ()) -> list[str]:
    return [
        sys.executable, "-m", "balancer", "replica", "--port", str(port), "--profile", profile,
        "--model", model, "--time-scale", str(time_scale), *extra,
    ]


def kvlb_config(
    port: int,
    replica_urls: Sequence[str],
    policy: str,
    params: Mapping[str, Any] | None = None,
    seed: int | None = 0,
    model: str = MODEL,
    labels: Sequence[Mapping[str, str]] | None = None,
    routing: Mapping[str, Any] | None = None,
    max_concurrency: int | None = None,
    replica_settings: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """`replica_settings`: more keys for every replica's entry (its `lora_load_ms`, say)."""
    replicas = []
    for i, url in enumerate(replica_urls):
        replica: dict[str, Any] = {"url": url, "name": f"replica-{i}", "model": model, **(replica_settings or {})}
        if max_concurrency is not None:
            replica["max_concurrency"] = max_concurrency
        if labels is not None:
            replica["labels"] = dict(labels[i])
        replicas.append(replica)
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "replicas": replicas,
        "policy": {"name": policy, "params": dict(params or {}), "seed": seed},
        "health": {"interval_s": 1.0},
        "limits": {"max_in_flight": HARNESS_LIMITS.max_in_flight},
        "routing": dict(routing or {}),
    }


class LiveFleet:
    """N simulated replica processes; optionally a router in front (kvlb or a command)."""

    def __init__(
        self,
        replicas: int,
        profile: str = "llama-3.1-8b-h100",
        time_scale: float = 10.0,
        model: str = MODEL,
        replica_args: Sequence[str] = (),
        time_scales: Sequence[float] | None = None,
        replica_settings: Mapping[str, Any] | None = None,
    ) -> None:
        """`time_scales`: one per replica, where they differ (a replica at a fifth of the
        others' time scale runs five times slower than its profile claims).
        `replica_settings`: more keys for each replica's entry in kvlb's configuration."""
        if time_scales is not None and len(time_scales) != replicas:
            raise ValueError(f"{len(time_scales)} time scales for {replicas} replicas")
        self.count = replicas
        self.time_scales = list(time_scales) if time_scales is not None else [time_scale] * replicas
        self.profile = profile
        self.time_scale = time_scale
        self.model = model
        self.replica_args = list(replica_args)
        self.replica_settings = dict(replica_settings or {})
        self.ports: list[int] = []
        self._replicas: list[subprocess.Popen] = []
        self._routers: list[subprocess.Popen] = []
        self._tmp = tempfile.TemporaryDirectory(prefix="kvlb-live-")
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")

    @property
    def replica_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.ports]

    @property
    def replica_names(self) -> list[str]:
        return [f"replica-{i}" for i in range(self.count)]

    async def start_replicas(self) -> None:
        """Fresh replicas: empty caches, idle engines."""
        self.stop_replicas()
        self.ports = [free_port() for _ in range(self.count)]
        for port, scale in zip(self.ports, self.time_scales, strict=True):
            self._replicas.append(start_process(
                replica_command(port, self.profile, scale, self.model, self.replica_args), self.env
            ))
        for url in self.replica_urls:
            await wait_for_http(url + "/health", timeout_s=30)

    async def start_kvlb(self, policy: str, params: Mapping[str, Any] | None = None, seed: int | None = 0,
                         routing: Mapping[str, Any] | None = None, sync: Mapping[str, Any] | None = None,
                         replace: bool = True, workers: int = 1, max_concurrency: int | None = None,
                         extra: Mapping[str, Any] | None = None) -> str:
        """kvlb in front of the replicas; `replace=False` adds an instance beside those running
        (with `sync`, they share routing state). `extra`: more configuration sections (for
        example flow_control, auth and limits), replacing those of the same name."""
        port = free_port()
        config = kvlb_config(port, self.replica_urls, policy, params, seed, self.model, routing=routing,
                             max_concurrency=max_concurrency, replica_settings=self.replica_settings)
        if sync is not None:
            config["sync"] = dict(sync)
        config.update(extra or {})
        path = Path(self._tmp.name) / f"kvlb-{policy}-{port}.yaml"
        path.write_text(yaml.safe_dump(config))
        argv = [sys.executable, "-m", "balancer", "serve", "--config", str(path)]
        if workers > 1:
            argv += ["--workers", str(workers)]
        return await self._start_router(argv, port, "/ready", replace=replace)

    async def start_external(self, command_template: str, ready_path: str = "/v1/models") -> str:
        """Another router from a command template: `{port}` is where it must listen, `{workers}`
        the replica URLs separated by spaces, `{workers_csv}` separated by commas."""
        port = free_port()
        command = command_template.format(
            port=port, workers=" ".join(self.replica_urls), workers_csv=",".join(self.replica_urls)
        )
        env = dict(self.env, HF_HUB_OFFLINE="1", HF_ENDPOINT="http://127.0.0.1:9")
        return await self._start_router(shlex.split(command), port, ready_path, env)

    async def _start_router(self, argv: list[str], port: int, ready_path: str,
                            env: dict[str, str] | None = None, replace: bool = True) -> str:
        if replace:
            self.stop_router()
        router = start_process(argv, env or self.env)
        self._routers.append(router)
        url = f"http://127.0.0.1:{port}"
        try:
            await wait_for_http(url + ready_path, timeout_s=60)
        except TimeoutError:
            code = router.poll()
            stop_process(router)
            self._routers.remove(router)
            state = f"exited with status {code}" if code is not None else "did not answer"
            raise RuntimeError(f"router {shlex.join(argv)!r} {state} at {url}{ready_path}") from None
        return url

    async def replica_request_counts(self) -> dict[str, int]:
        """Requests each replica finished, from its own `vllm:request_success_total`."""
        counts: dict[str, int] = {}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            for name, url in zip(self.replica_names, self.replica_urls, strict=True):
                async with http.get(url + "/metrics") as resp:
                    text = await resp.text()
                counts[name] = sum(
                    int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
                    if line.startswith("vllm:request_success_total")
                )
        return counts

    def routers_cpu_seconds(self) -> float:
        """CPU time (user + system) the running routers have used so far, their children
        and threads included: read before and after a run, it is what routing the run cost."""
        return sum(tree_cpu_seconds(router.pid) for router in self._routers)

    def stop_router(self) -> None:
        """Every router started, kvlb instances and external ones."""
        for router in self._routers:
            stop_process(router)
        self._routers = []

    def stop_replicas(self) -> None:
        for proc in self._replicas:
            stop_process(proc)
        self._replicas = []

    def stop(self) -> None:
        self.stop_router()
        self.stop_replicas()

    async def __aenter__(self) -> LiveFleet:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.stop()
        self._tmp.cleanup()
