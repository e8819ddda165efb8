"""`kvlb serve --workers N`: N processes on one port, so one host uses all its cores.

Each worker is a whole kvlb (`kvlb serve ... --reuse-port`) listening with SO_REUSEPORT; the
kernel spreads new connections over them. They share routing state through Redis
(balancer/watchers/sync.py) when `sync.redis_url` is set. This process only supervises: it passes
SIGTERM, SIGINT and SIGHUP on to every worker, restarts a worker that dies, and exits when
all have stopped after a signal.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time

from balancer.process.children import dies_with_parent

log = logging.getLogger("kvlb.workers")

RESTART_DELAY_S = 1.0
POLL_S = 0.2


def _start(argv: list[str]) -> subprocess.Popen:
    # A supervisor killed outright runs no cleanup; its workers must not outlive it.
    return subprocess.Popen(argv, preexec_fn=dies_with_parent())


def supervise(count: int, argv: list[str], port: int) -> int:
    workers: list[subprocess.Popen] = [_start(argv) for _ in range(count)]
    log.info("kvlb supervising %d workers on port %d", count, port)
    stopping: list[int] = []

    def forward(sig: int, _frame: object) -> None:
        if sig != signal.SIGHUP:
            stopping.append(sig)
        for worker in workers:
            if worker.poll() is None:
                worker.send_signal(sig)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    try:
        while True:
            if stopping:
                if all(worker.poll() is not None for worker in workers):
                    return 0
            else:
                for i, worker in enumerate(workers):
                    code = worker.poll()
                    if code is not None and not stopping:
                        log.warning("worker %d (pid %d) exited with status %s; restarting it", i, worker.pid, code)
                        time.sleep(RESTART_DELAY_S)
                        if not stopping:
                            workers[i] = _start(argv)
            time.sleep(POLL_S)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.terminate()
        for worker in workers:
            try:
                worker.wait(timeout=10)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
