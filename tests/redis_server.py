"""A private Redis server per test, so tests can stop and restart it without touching anyone
else's; falls back to the machine's own on 127.0.0.1:6379 when `redis-server` is not installed."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import uuid

from loadtest.procs import free_port

SHARED_URL = "redis://127.0.0.1:6379/0"


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    def __init__(self) -> None:
        self.binary = shutil.which("redis-server")
        self.port = free_port() if self.binary else 6379
        self.process: subprocess.Popen | None = None
        # Keys of different tests never meet, even on a shared server.
        self.prefix = f"kvlbtest-{uuid.uuid4().hex[:8]}"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def private(self) -> bool:
        return self.binary is not None

    def start(self) -> RedisServer:
        if self.binary is None:
            if not _answers(self.port):
                raise RuntimeError("no redis-server binary and nothing answers on 127.0.0.1:6379")
            return self
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while not _answers(self.port):
            if time.monotonic() > deadline or self.process.poll() is not None:
                self.stop()
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None

    def sync_settings(self, **extra: object) -> dict[str, object]:
        return {"redis_url": self.url, "key_prefix": self.prefix, **extra}
