from __future__ import annotations

import copy
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp import web

from balancer.app import Balancer, start_balancer
from balancer.config import Settings, parse_settings
from loadtest.compare.stub_replica import make_stub_app
from tests.redis_server import RedisServer

# Test servers stay below 32768: ports above are the kernel's ephemeral range, where an
# outgoing connection may already hold the port.
TEST_PORT_RANGE = (20000, 32000)


async def start_site(runner: web.BaseRunner) -> int:
    """Start `runner` on a free port of 127.0.0.1 in TEST_PORT_RANGE; return the port."""
    for _ in range(100):
        port = random.randrange(*TEST_PORT_RANGE)
        site = web.TCPSite(runner, "127.0.0.1", port)
        try:
            await site.start()
        except OSError:
            continue
        return port
    raise RuntimeError("no free test port")


@asynccontextmanager
async def serve_app(app: web.Application, *, handler_cancellation: bool = True) -> AsyncIterator[str]:
    """Serve `app` on a free port of 127.0.0.1 and yield its base URL."""
    runner = web.AppRunner(app, handler_cancellation=handler_cancellation, access_log=None)
    await runner.setup()
    try:
        port = await start_site(runner)
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def make_settings(replicas: list[str | dict[str, Any]], **sections: Any) -> Settings:
    """Settings for a test balancer: each replica a URL or a full replica mapping."""
    data: dict[str, Any] = {
        "listen": {"host": "127.0.0.1"},
        "replicas": [r if isinstance(r, dict) else {"url": r} for r in replicas],
        # Tests drive health explicitly; a background round must not race them.
        "health": {"interval_s": 3600},
    }
    return parse_settings(_merge(data, sections))


@asynccontextmanager
async def run_balancer(settings: Settings) -> AsyncIterator[TestBalancer]:
    """A balancer on a free test port of 127.0.0.1, stopped on exit."""
    last_error: OSError | None = None
    for _ in range(50):
        try:
            running = await start_balancer(settings, port=random.randrange(*TEST_PORT_RANGE))
        except OSError as exc:
            last_error = exc
            continue
        try:
            yield TestBalancer(f"http://127.0.0.1:{running.port}", running.balancer)
        finally:
            await running.close(grace_s=1.0)
        return
    raise RuntimeError(f"no free test port: {last_error}")


class TestBalancer:
    __test__ = False  # not a test class, whatever its name

    def __init__(self, url: str, balancer: Balancer) -> None:
        self.url = url
        self.balancer = balancer


@pytest.fixture
def redis_server():
    """A Redis of the test's own (tests/redis_server.py), stopped after it."""
    try:
        server = RedisServer().start()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def stub_app() -> Callable[..., web.Application]:
    return make_stub_app
