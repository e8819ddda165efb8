"""Machinery shared by the abuse suite.

kvlb runs as its own process, as in production, so what is measured (resident memory, open
sockets, the log it writes) is kvlb's alone and a crash shows as a dead process rather than a
failed test helper. Its upstreams are simulated replicas (processes) or the misbehaving
`RawUpstream`s of `tests/abuse/upstreams.py`. Clients speak raw HTTP/1.1 over sockets (`RawConn`), which is how attackers speak.

Every test has the same shape (`under_attack`): a `GoodClient` sends small non-streamed and
streamed chat completions through kvlb on one keep-alive connection while an attack runs
beside it; at the end every one of its requests must have succeeded, kvlb must still be
running, and its resident memory must be back within `RSS_SLACK` of where it was before.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import yaml
from prometheus_client.parser import text_string_to_metric_families

from balancer.process.children import dies_with_parent
from loadtest.procs import free_port, stop_process
from tests.conftest import _merge

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
MODEL = "sim-model"
RSS_SLACK = 32 * MiB
# Simulated replicas, fast enough that a 4-token answer takes milliseconds.
SIM_ARGS = ("--model", MODEL, "--time-scale", "50", "--log-level", "WARNING")
# What every kvlb of the suite runs with, under each test's own settings: no background
# health or model rounds, so nothing but the test's own traffic changes its state.
BASE_CONFIG: dict[str, Any] = {
    "health": {"interval_s": 3600},
    "models": {"refresh_s": 3600},
}
READ_LIMIT = 4 * MiB
CHAT = "/v1/chat/completions"
JSON = ("Content-Type", "application/json")


def replica(url: str, name: str, model: str = MODEL, **extra: Any) -> dict[str, Any]:
    return {"url": url, "name": name, "model": model, **extra}


def sim_replicas(urls: Sequence[str]) -> list[dict[str, Any]]:
    return [replica(url, f"sim-{i}") for i, url in enumerate(urls)]


# --- kvlb as a process -------------------------------------------------------------------------


class Kvlb:
    """One `kvlb serve --config FILE` process; stdout and stderr go to `log_path`."""

    def __init__(self, proc: subprocess.Popen, port: int, config: dict[str, Any], log_path: Path) -> None:
        self.proc = proc
        self.port = port
        self.config = config
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss(self) -> int:
        return rss_bytes(self.pid)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, chars: int = 3000) -> str:
        return self.log()[-chars:]

    def stop(self) -> None:
        stop_process(self.proc)


def start_kvlb(directory: Path, config: Mapping[str, Any], env: Mapping[str, str] | None = None,
               timeout_s: float = 20.0) -> Kvlb:
    """kvlb with BASE_CONFIG under `config`, serving once /health answers. A port another
    process took in the meantime is retried with another."""
    for _ in range(5):
        port = free_port()
        data = _merge(BASE_CONFIG, dict(config))
        data["listen"] = {"host": "127.0.0.1", "port": port}
        path = directory / f"kvlb-{port}.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        log_path = directory / f"kvlb-{port}.log"
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(
                [sys.executable, "-m", "balancer", "serve", "--config", str(path)],
                cwd=ROOT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=dies_with_parent(),
            )
        kvlb = Kvlb(proc, port, data, log_path)
        try:
            if _wait_serving(kvlb, timeout_s):
                return kvlb
        except BaseException:
            kvlb.stop()
            raise
        kvlb.stop()
        text = kvlb.log()
        if "address already in use" not in text.lower():
            raise RuntimeError(f"kvlb did not start (exit status {proc.returncode}):\n{text[-3000:]}")
    raise RuntimeError("no free port for kvlb")


def _wait_serving(kvlb: Kvlb, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not kvlb.alive():
            return False
        if get_status_sync(kvlb.port, "/health") == 200:
            return True
        time.sleep(0.05)
    raise RuntimeError(f"kvlb did not answer /health within {timeout_s} s:\n{kvlb.log_tail()}")


def get_status_sync(port: int, path: str, timeout_s: float = 1.0) -> int | None:
    """The status of one GET, without an event loop (so it can wait while a test's loop is
    blocked); None when nothing answers."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: kvlb\r\nConnection: close\r\n\r\n".encode())
            data = sock.recv(64)
    except OSError:
        return None
    parts = data.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


def run_cli(*args: str, timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "balancer", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout_s, env=dict(os.environ))


# --- resident memory ---------------------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


async def steady_rss(pid: int, reads: int = 3, gap_s: float = 0.1) -> int:
    samples = []
    for i in range(reads):
        if i:
            await asyncio.sleep(gap_s)
        samples.append(rss_bytes(pid))
    return int(statistics.median(samples))


async def rss_settled(pid: int, baseline: int, slack: int = RSS_SLACK, timeout_s: float = 5.0) -> int:
    """RSS once it is within `slack` of `baseline`, or its last reading after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        rss = rss_bytes(pid)
        if rss <= baseline + slack or time.monotonic() > deadline:
            return rss
        await asyncio.sleep(0.2)


# --- raw HTTP/1.1 clients ----------------------------------------------------------------------


def request_bytes(method: str, path: str, body: bytes = b"", headers: Iterable[tuple[str, str]] = (),
                  *, length: bool = True) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: kvlb"]
    lines += [f"{name}: {value}" for name, value in headers]
    if length and (body or method in ("POST", "PUT")):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def chat_body(model: str = MODEL, content: str = "hello there", max_tokens: int = 4, stream: bool = False,
              **extra: Any) -> bytes:
    return orjson.dumps({"model": model, "messages": [{"role": "user", "content": content}],
                         "max_tokens": max_tokens, "stream": stream, **extra})


def bearer(key: str) -> tuple[str, str]:
    return ("Authorization", f"Bearer {key}")


@dataclass
class Answer:
    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: bytes
    head: bytes  # status line and headers exactly as received
    interim: list[str] = field(default_factory=list)  # 1xx status lines that came first

    def header(self, name: str) -> str | None:
        lower = name.lower()
        return next((v for n, v in self.headers if n.lower() == lower), None)

    @property
    def closes(self) -> bool:
        return "close" in (self.header("connection") or "").lower()

    def error(self) -> dict[str, Any]:
        """The OpenAI-format error object of kvlb's own refusals, checked for its shape."""
        try:
            data = orjson.loads(self.body)
        except orjson.JSONDecodeError:
            raise AssertionError(f"HTTP {self.status} body is not JSON: {self.body[:300]!r}") from None
        error = data.get("error") if isinstance(data, dict) else None
        assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, (
            f"HTTP {self.status} body is not an OpenAI error: {self.body[:300]!r}")
        return error

    def __repr__(self) -> str:
        return f"Answer({self.status}, {self.body[:200]!r})"


async def read_answer(reader: asyncio.StreamReader, method: str = "POST",
                      interim: list[str] | None = None) -> Answer:
    """One answer, parsed strictly; 1xx interim answers before it are skipped (and listed)."""
    interim = [] if interim is None else interim
    while True:
        head = await reader.readuntil(b"\r\n\r\n")
        status_line, *lines = head[:-4].decode("latin-1").split("\r\n")
        version, status_text, reason = (status_line.split(" ", 2) + ["", ""])[:3]
        if not version.startswith("HTTP/1.") or not status_text.isdigit():
            raise ValueError(f"not an HTTP/1.x status line: {status_line[:100]!r}")
        status = int(status_text)
        if not 100 <= status < 200:
            break
        interim.append(status_line)
    headers = []
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep:
            raise ValueError(f"malformed header line: {line[:100]!r}")
        headers.append((name.strip(), value.strip()))
    answer = Answer(status, reason, headers, b"", head, list(interim))
    length = answer.header("content-length")
    if method == "HEAD" or status in (204, 304):
        pass
    elif (answer.header("transfer-encoding") or "").lower() == "chunked":
        answer.body = await _read_chunked(reader)
    elif length is not None:
        answer.body = await reader.readexactly(int(length))
    else:
        answer.body = await reader.read()
    return answer


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts = []
    while True:
        line = await reader.readuntil(b"\r\n")
        size = int(line.split(b";")[0], 16)
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":
                pass  # trailers
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        if await reader.readexactly(2) != b"\r\n":
            raise ValueError("bad chunk framing")


async def parse_answer(data: bytes, method: str = "POST") -> Answer:
    """The first answer in bytes already read (say, everything up to the close)."""
    reader = asyncio.StreamReader(limit=READ_LIMIT)
    reader.feed_data(data)
    reader.feed_eof()
    return await read_answer(reader, method)


async def connected_socket(port: int, source: str = "127.0.0.1", rcvbuf: int | None = None,
                           timeout_s: float = 5.0) -> socket.socket:
    """A non-blocking socket connected to kvlb from `source` (any 127.x.y.z: each looks like
    another client); `rcvbuf` is set before connecting, so the window is small from the start."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.bind((source, 0))
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port)), timeout_s)
    except BaseException:
        sock.close()
        raise
    return sock


class RawConn:
    """One client connection; requests are written as given, answers parsed strictly."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.interim: list[str] = []  # 1xx lines before the last answer read

    @classmethod
    async def open(cls, port: int, source: str = "127.0.0.1", rcvbuf: int | None = None) -> RawConn:
        sock = await connected_socket(port, source, rcvbuf)
        reader, writer = await asyncio.open_connection(sock=sock, limit=READ_LIMIT)
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def request(self, method: str, path: str, body: bytes = b"",
                      headers: Iterable[tuple[str, str]] = (), timeout_s: float = 10.0) -> Answer:
        await self.send(request_bytes(method, path, body, headers))
        return await self.read_answer(timeout_s, method)

    async def read_answer(self, timeout_s: float = 10.0, method: str = "POST") -> Answer:
        self.interim = []
        async with asyncio.timeout(timeout_s):
            return await read_answer(self.reader, method, self.interim)

    async def answer_within(self, timeout_s: float, what: str, method: str = "POST") -> Answer:
        """The next answer, or an assertion that says what came instead."""
        try:
            return await self.read_answer(timeout_s, method)
        except TimeoutError:
            first = f" (only {self.interim[0]!r} came)" if self.interim else ""
            raise AssertionError(f"{what}: no answer within {timeout_s:g} s{first}") from None
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise AssertionError(f"{what}: the connection ended without an answer ({exc!r})") from None

    async def read_until_closed(self, timeout_s: float = 5.0) -> bytes | None:
        """Everything up to the peer's close (a reset counts as closed); None if it stays open."""
        out = bytearray()
        try:
            async with asyncio.timeout(timeout_s):
                while data := await self.reader.read(65536):
                    out += data
        except TimeoutError:
            return None
        except ConnectionError:
            pass
        return bytes(out)

    def close(self) -> None:
        self.writer.close()

    def abort(self) -> None:
        self.writer.transport.abort()


async def get(port: int, path: str, headers: Iterable[tuple[str, str]] = (), source: str = "127.0.0.1",
              timeout_s: float = 5.0) -> Answer:
    conn = await RawConn.open(port, source)
    try:
        return await conn.request("GET", path, headers=headers, timeout_s=timeout_s)
    finally:
        conn.close()


async def post(port: int, path: str, body: bytes, headers: Iterable[tuple[str, str]] = (),
               source: str = "127.0.0.1", timeout_s: float = 10.0) -> Answer:
    conn = await RawConn.open(port, source)
    try:
        return await conn.request("POST", path, body, headers, timeout_s=timeout_s)
    finally:
        conn.close()


def answer_problem(answer: Answer, stream: bool) -> str | None:
    """Why `answer` is not a complete, successful chat completion (None when it is one)."""
    if answer.status != 200:
        return f"HTTP {answer.status}: {answer.body[:200]!r}"
    if stream:
        if not answer.body.rstrip().endswith(b"data: [DONE]"):
            return f"stream ended without [DONE]: ...{answer.body[-200:]!r}"
        return None
    try:
        data = orjson.loads(answer.body)
    except orjson.JSONDecodeError:
        return f"body is not JSON: {answer.body[:200]!r}"
    if not isinstance(data, dict) or not data.get("choices"):
        return f"no choices in {answer.body[:200]!r}"
    return None


class GoodClient:
    """Small chat completions, alternately whole and streamed, one after another on one
    keep-alive connection opened before any attack (a new one only if kvlb closes it)."""

    def __init__(self, port: int, *, model: str = MODEL, api_key: str | None = None, gap_s: float = 0.02,
                 source: str = "127.0.0.1") -> None:
        self.port = port
        self.model = model
        self.headers = [JSON] + ([bearer(api_key)] if api_key else [])
        self.gap_s = gap_s
        self.source = source
        self.ok = 0
        self.failures: list[str] = []
        self.connections = 0
        self._conn: RawConn | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._resume = asyncio.Event()
        self._resume.set()
        self._idle = asyncio.Event()
        self._started = 0.0

    async def start(self, warm: int = 4, timeout_s: float = 10.0) -> None:
        """Returns once `warm` requests succeeded: kvlb, its pools and the replicas are warm."""
        self._started = time.monotonic()
        self._task = asyncio.create_task(self._run())
        deadline = time.monotonic() + timeout_s
        while self.ok < warm:
            assert not self.failures, f"the well-behaved client failed before any attack: {self.failures[:3]}"
            assert not self._task.done(), "the well-behaved client stopped"
            assert time.monotonic() < deadline, "the well-behaved client did not get going"
            await asyncio.sleep(0.01)

    async def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            if not self._resume.is_set():
                self._idle.set()
                await self._resume.wait()
                self._idle.clear()
                continue
            stream = i % 2 == 1
            i += 1
            problem = None
            try:
                if self._conn is None:
                    self._conn = await RawConn.open(self.port, self.source)
                    self.connections += 1
                answer = await self._conn.request(
                    "POST", CHAT, chat_body(self.model, stream=stream), self.headers)
                problem = answer_problem(answer, stream)
                if answer.closes:
                    self._drop()
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError,
                    ValueError) as exc:
                problem = f"{type(exc).__name__}: {exc}"
                self._drop()
            if problem is None:
                self.ok += 1
            else:
                kind = "streamed" if stream else "whole"
                self.failures.append(f"#{i} ({kind}, +{time.monotonic() - self._started:.2f} s): {problem}")
            await asyncio.sleep(self.gap_s)

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.abort()
            self._conn = None

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """No request of this client in flight inside the block."""
        self._resume.clear()
        await asyncio.wait_for(self._idle.wait(), 15)
        try:
            yield
        finally:
            self._resume.set()

    async def stop(self) -> None:
        self._stop.set()
        self._resume.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, 15)
            except TimeoutError:
                self.failures.append("a request was still unanswered 15 s after the attack")
        self._drop()

    def check(self, min_ok: int = 4) -> None:
        assert not self.failures, (
            f"the well-behaved client failed {len(self.failures)} of {self.ok + len(self.failures)} "
            f"requests, first: {self.failures[:4]}")
        assert self.ok >= min_ok, f"the well-behaved client got only {self.ok} answers"


@dataclass
class Watch:
    kvlb: Kvlb
    baseline_rss: int
    peak_rss: int = 0

    def sample(self) -> int:
        rss = self.kvlb.rss()
        self.peak_rss = max(self.peak_rss, rss)
        return rss


@contextlib.asynccontextmanager
async def under_attack(kvlb: Kvlb, good: GoodClient | None, *, rss_slack: int = RSS_SLACK,
                       settle_s: float = 3.0) -> AsyncIterator[Watch]:
    """The good client runs through the block (the attack); after it: the good client got
    every answer, kvlb is alive, and its RSS is back near the baseline taken before."""
    if good is not None:
        await good.start()
    watch = Watch(kvlb, await steady_rss(kvlb.pid))
    try:
        yield watch
    finally:
        if good is not None:
            await good.stop()
    assert kvlb.alive(), f"kvlb exited with status {kvlb.proc.returncode}:\n{kvlb.log_tail()}"
    if good is not None:
        good.check()
    rss = await rss_settled(kvlb.pid, watch.baseline_rss, rss_slack, settle_s)
    assert rss <= watch.baseline_rss + rss_slack, (
        f"kvlb's RSS stayed at {rss / MiB:.0f} MiB, {(rss - watch.baseline_rss) / MiB:.0f} MiB above its "
        f"baseline of {watch.baseline_rss / MiB:.0f} MiB {settle_s:g} s after the attack "
        f"(peak seen {watch.peak_rss / MiB:.0f} MiB; allowed {rss_slack / MiB:.0f} MiB)")


async def wait_until(predicate: Callable[[], Any], timeout_s: float, what: str, gap_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        await asyncio.sleep(gap_s)


# --- sockets as the kernel sees them ----------------------------------------------------------

_TCP_OPEN_STATES = {"01", "08"}  # ESTABLISHED, CLOSE_WAIT: the owner has not closed its end


def _tcp_entry(local_port: int, remote_port: int) -> list[str] | None:
    """The /proc/net/tcp line of the socket from `local_port` to `remote_port`, split."""
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            if (int(fields[1].rsplit(":", 1)[1], 16) == local_port
                    and int(fields[2].rsplit(":", 1)[1], 16) == remote_port):
                return fields
    return None


def server_side_open(server_port: int, client_port: int) -> bool:
    """Whether the server's end of the connection from `client_port` is still open: read from
    the kernel, so a client that never reads can tell without reading."""
    entry = _tcp_entry(server_port, client_port)
    return entry is not None and entry[3] in _TCP_OPEN_STATES


def bytes_in_transit(server_port: int, client_port: int) -> int:
    """Bytes a client sent that the server has not read yet: still in the client's send
    queue or in the server's receive queue."""
    total = 0
    for local, remote, queue in ((client_port, server_port, 0), (server_port, client_port, 1)):
        entry = _tcp_entry(local, remote)
        if entry is not None:
            total += int(entry[4].split(":")[queue], 16)
    return total


# --- /metrics --------------------------------------------------------------------------------


@dataclass
class Scrape:
    samples: list[tuple[str, dict[str, str], float]]

    def series(self, name: str) -> list[tuple[dict[str, str], float]]:
        return [(labels, value) for n, labels, value in self.samples if n == name]

    def value(self, name: str, **labels: str) -> float:
        """The sum over the series of `name` whose labels include `labels` (0 when none)."""
        return sum(v for lab, v in self.series(name) if all(lab.get(k) == x for k, x in labels.items()))

    def by(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for labels, value in self.series(name):
            out[labels.get(label, "")] = out.get(labels.get(label, ""), 0.0) + value
        return out


async def scrape(port: int) -> Scrape:
    answer = await get(port, "/metrics")
    assert answer.status == 200, answer
    samples = [
        (s.name, dict(s.labels), s.value)
        for family in text_string_to_metric_families(answer.body.decode())
        for s in family.samples
    ]
    return Scrape(samples)
