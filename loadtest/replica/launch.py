"""Start simulated replicas for tests, benchmarks and demos, and always stop them again.

Ports come from below the kernel's ephemeral range (32768 and up), where outgoing connections
take theirs, so a listener never collides with a client socket; a port already taken is
retried with another. A prefill replica's bootstrap port is drawn the same way when the caller
asks for it (`pick_bootstrap_port`), so two replicas or tests never race for a fixed one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import random
import re
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence

from loadtest.procs import read_cpu_seconds
from loadtest.replica.config import ReplicaConfig
from loadtest.replica.server import ReplicaServer

PORT_RANGE = (20000, 32768)
PORT_ATTEMPTS = 50
BOOTSTRAP_PORT = re.compile(r"\(bootstrap port (\d+)\)")


def random_port() -> int:
    return random.randrange(*PORT_RANGE)


@contextlib.asynccontextmanager
async def running_replica(
    config: ReplicaConfig | None = None, pick_bootstrap_port: bool = False
) -> AsyncIterator[ReplicaServer]:
    """A replica in this process's event loop, on a free port unless `config.port` is set.

    With `pick_bootstrap_port`, its bootstrap port (a prefill replica's KV side channel) is a
    free one below the ephemeral range too, drawn again whenever it is taken.
    """
    config = config or ReplicaConfig()
    for attempt in range(PORT_ATTEMPTS):
        port = config.port or random_port()
        drawn = dataclasses.replace(config, port=port)
        if pick_bootstrap_port:
            drawn = dataclasses.replace(drawn, disaggregation_bootstrap_port=random_port())
        server = ReplicaServer(drawn)
        try:
            await server.start()
            break
        except OSError as error:
            await server.stop()
            # With the HTTP port bound, the taken one was another (the bootstrap port), which
            # a new HTTP port does not free unless the bootstrap port is drawn anew as well.
            taken_here = error.errno == errno.EADDRINUSE and (
                server.port is None or pick_bootstrap_port
            )
            if not taken_here or config.port or attempt == PORT_ATTEMPTS - 1:
                raise
    try:
        yield server
    finally:
        await server.stop()


class ReplicaProcess:
    """`python -m loadtest.replica` as a child process; use as a context manager."""

    def __init__(
        self,
        args: Sequence[str] = (),
        startup_timeout_s: float = 30.0,
        pick_bootstrap_port: bool = False,
    ) -> None:
        self.args = list(args)
        # Drawn per attempt, as the HTTP port is, rather than fixed in `args` by the caller.
        self.pick_bootstrap_port = pick_bootstrap_port
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen[str] | None = None
        self.port: int | None = None
        self.bootstrap_port: int | None = None  # a prefill replica's, from its ready line
        # A file, not a pipe: a child logging more than a pipe holds would block on it.
        self._stderr = tempfile.TemporaryFile(mode="w+")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self) -> ReplicaProcess:
        for _ in range(PORT_ATTEMPTS):
            port = random_port()
            self._stderr.seek(0)
            self._stderr.truncate()
            ports = ["--port", str(port)]
            if self.pick_bootstrap_port:
                ports += ["--disaggregation-bootstrap-port", str(random_port())]
            process = subprocess.Popen(
                [sys.executable, "-m", "loadtest.replica", *ports, *self.args],
                stdout=subprocess.PIPE,
                stderr=self._stderr,
                text=True,
            )
            self.process = process
            line = self._read_ready_line(process)
            if line is not None:
                self.port = port
                match = BOOTSTRAP_PORT.search(line)
                self.bootstrap_port = int(match.group(1)) if match else None
                return self
            stderr = self._reap(process)
            # Another HTTP port frees no taken bootstrap port, unless that is drawn anew too.
            bootstrap_taken = "bootstrap port" in stderr and not self.pick_bootstrap_port
            if "address already in use" not in stderr.lower() or bootstrap_taken:
                raise RuntimeError(f"replica failed to start: {stderr.strip()[-2000:]}")
        raise RuntimeError("no free port found for the replica")

    def _read_ready_line(self, process: subprocess.Popen[str]) -> str | None:
        """The child's "listening on" line; None if it exited first (e.g. port taken)."""
        assert process.stdout is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            readable, _, _ = select.select([process.stdout], [], [], min(remaining, 0.5))
            if readable:
                # The child prints whole lines and flushes, so this does not block long.
                line = process.stdout.readline()
                if "listening on" in line:
                    return line
                if not line:
                    process.wait(timeout=5)
                    return None
            elif process.poll() is not None:
                return None
        self.stop()
        raise TimeoutError("replica did not start in time")

    def _reap(self, process: subprocess.Popen[str]) -> str:
        _wait_then_kill(process)
        return self.stderr_text()

    def stderr_text(self) -> str:
        self._stderr.flush()
        self._stderr.seek(0)
        return self._stderr.read()

    def stop(self) -> int | None:
        """Terminate (then kill) the child; returns its exit status."""
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            process.terminate()
        _wait_then_kill(process)
        return process.returncode

    def cpu_seconds(self) -> float:
        """User plus system CPU time of the child so far, from /proc (Linux)."""
        return read_cpu_seconds(self.pid)

    def __enter__(self) -> ReplicaProcess:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _wait_then_kill(process: subprocess.Popen[str], grace_s: float = 5.0) -> None:
    """Let an exiting child finish within `grace_s`, kill it past that, close its pipe."""
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    if process.stdout is not None:
        process.stdout.close()
