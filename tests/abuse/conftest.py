from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from loadtest.replica.launch import ReplicaProcess
from tests.abuse.harness import (
    SIM_ARGS,
    Kvlb,
    sim_replicas,
    start_kvlb,
)
from tests.abuse.slowloris import Slowloris
from tests.abuse.upstreams import (
    Handler,
    RawUpstream,
)


@pytest.fixture(scope="session")
def sim() -> Iterator[list[str]]:
    """Two simulated replicas for the whole suite: every test gets a kvlb of its own, and
    no attack here is aimed at the replicas, so they can be shared."""
    replicas = [ReplicaProcess(SIM_ARGS) for _ in range(2)]
    try:
        for proc in replicas:
            proc.start()
        yield [proc.url for proc in replicas]
    finally:
        for proc in replicas:
            proc.stop()


@pytest.fixture
def kvlb(tmp_path: Path) -> Iterator[Callable[..., Kvlb]]:
    """Starts kvlb processes from config mappings; all of them stop when the test ends."""
    started: list[Kvlb] = []

    def start(config: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Kvlb:
        process = start_kvlb(tmp_path, config, env)
        started.append(process)
        return process

    try:
        yield start
    finally:
        for process in started:
            process.stop()


@pytest.fixture
def upstream() -> Iterator[Callable[..., RawUpstream]]:
    """Starts RawUpstreams; all of them stop when the test ends."""
    started: list[RawUpstream] = []

    def start(handler: Handler | None = None, **kwargs: Any) -> RawUpstream:
        server = RawUpstream(handler, **kwargs)
        started.append(server)
        return server.start()

    try:
        yield start
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="session", autouse=True)
def slowloris(sim: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slowloris]:
    """The slowloris attack, begun with the suite so that its 30 s pass while the other
    tests run (see slowloris.py); test_slowloris.py collects the outcome."""
    k = start_kvlb(tmp_path_factory.mktemp("slowloris"), {"replicas": sim_replicas(sim)})
    attack = Slowloris(k)
    try:
        yield attack.start()
    finally:
        attack.stop()
        k.stop()
