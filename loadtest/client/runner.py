"""`kvlb loadtest`: an open-loop load client for OpenAI-compatible servers (kvlb or a replica).

Each request leaves at its workload arrival time whatever happened to the ones before it, as
real users' requests do; a closed loop would slow its own offered load down exactly when the
server struggles and hide the queueing that a balancer is meant to avoid. The concurrency cap
is only a safety valve for the client's own sockets, and every request that had to wait for it
is counted.

Times are measured in real seconds and reported in model time (multiplied by the time scale),
so a run against replicas sped up tenfold reports what the modelled GPUs would have taken.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson

from balancer.protocol import (
    PRIORITY_HEADER,
    REJECT_REASON_HEADER,
    REPLICA_HEADER,
    SESSION_HEADER,
    TENANT_HEADER,
)
from loadtest.client.sse import (
    StreamReader,
    client_error_text,
    error_from_body,
    read_answer,
    usage_counts,
)
from loadtest.client.summary import (
    RequestRecord,
    error_digest,
    format_summary,
    summarize,
    write_results,
)

if TYPE_CHECKING:
    from loadtest.client.workloads import WorkRequest

PROBE_TIMEOUT_S = 5.0
PROGRESS_EVERY_S = 0.25
PROGRESS_EVERY_S_NO_TTY = 10.0
# uvloop's loop.time() moves in whole milliseconds, too coarse for token gaps.
now = time.perf_counter


class TargetError(RuntimeError):
    """The target could not be reached at all; nothing was sent."""


def _connect_error(target: str, exc: BaseException) -> TargetError:
    if isinstance(exc, TimeoutError):
        reason = f"no answer within {PROBE_TIMEOUT_S:g} s"
    elif isinstance(exc, aiohttp.ClientConnectorError):
        error = exc.os_error
        reason = type(error).__name__ + (f": {error.strerror}" if error.strerror else "")
    else:
        reason = str(exc) or type(exc).__name__
    return TargetError(f"target {target} is unreachable: {reason}")


async def _probe(http: aiohttp.ClientSession, target: str, path: str) -> tuple[int, Any]:
    """(status, JSON body or None) of a GET; TargetError when no HTTP answer comes."""
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            async with http.get(target + path) as resp:
                raw = await resp.read()
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise _connect_error(target, exc) from None
    try:
        return resp.status, orjson.loads(raw)
    except orjson.JSONDecodeError:
        return resp.status, None


async def detect_time_scale(target: str) -> tuple[float, str | None]:
    """The target's `time_scale` from /get_server_info, or 1.0 and the reason why not."""
    target = target.rstrip("/")
    async with aiohttp.ClientSession() as http:
        status, body = await _probe(http, target, "/get_server_info")
    scale = body.get("time_scale") if isinstance(body, dict) else None
    if status == 200 and type(scale) in (int, float) and scale > 0:
        return float(scale), None
    why = f"HTTP {status}" if status != 200 else "no time_scale in it"
    return 1.0, f"{target}/get_server_info gave no time scale ({why}); using 1 (real = model time)"


def _first_model(models: Any) -> str | None:
    data = models.get("data") if isinstance(models, dict) else None
    first = data[0] if isinstance(data, list) and data else None
    name = first.get("id") if isinstance(first, dict) else None
    return name if isinstance(name, str) else None


class _Run:
    def __init__(
        self, http: aiohttp.ClientSession, target: str, model: str | None, time_scale: float,
        max_concurrency: int, timeout_s: float, stream: bool,
    ) -> None:  # fmt: skip
        self.http = http
        self.target = target
        self.model = model
        self.scale = time_scale
        self.timeout_s = timeout_s
        self.stream = stream
        self.cap = asyncio.Semaphore(max_concurrency)
        self.cap_hits = 0
        self.done = 0
        self.errors = 0
        self.max_send_lag_s = 0.0
        self.start = now()

    def body(self, req: WorkRequest) -> bytes:
        return orjson.dumps(req.payload(model=self.model, stream=self.stream))

    async def send(self, req: WorkRequest, body: bytes, due: float) -> RequestRecord:
        if self.cap.locked():
            self.cap_hits += 1
        async with self.cap:
            record = await self._exchange(req, body, due)
        self.done += 1
        self.errors += not record.ok
        return record

    async def _exchange(self, req: WorkRequest, body: bytes, due: float) -> RequestRecord:
        headers = {"Content-Type": "application/json"}
        if req.session is not None:
            headers[SESSION_HEADER] = req.session
        if req.tenant is not None:
            headers[TENANT_HEADER] = req.tenant
        if req.priority is not None:
            headers[PRIORITY_HEADER] = req.priority
        scale = self.scale
        sent = now()
        self.max_send_lag_s = max(self.max_send_lag_s, (sent - due) * scale)
        record = RequestRecord(
            index=req.index, send_s=(sent - self.start) * scale, status=0, error=None,
            replica=None, session=req.session, prompt_tokens=0, cached_tokens=0,
            output_tokens=0, ttft_s=None, e2e_s=None, tpot_s=None, itl_s=[],
            tenant=req.tenant, priority=req.priority,
        )  # fmt: skip
        reader = StreamReader()
        usage: Any = None
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self.http.post(
                    self.target + req.route, data=body, headers=headers
                ) as resp:
                    record.status = resp.status
                    record.replica = resp.headers.get(REPLICA_HEADER)
                    if not 200 <= resp.status < 300:
                        record.error = error_from_body(await resp.read(), resp.status)
                        record.reject_reason = resp.headers.get(REJECT_REASON_HEADER)
                    elif self.stream:
                        async for line in resp.content:
                            reader.feed(line, now())
                            if reader.error is not None:
                                break
                        usage = reader.usage
                        record.error = reader.error
                        if record.error is None and not reader.done:
                            record.error = "stream ended before [DONE]"
                    else:
                        usage, has_content, record.error = read_answer(await resp.read())
                        reader.content_chunks = int(has_content)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            record.error = client_error_text(exc, self.timeout_s)
        ended = now()

        prompt, cached, completion = usage_counts(usage)
        record.prompt_tokens, record.cached_tokens = prompt, cached
        record.output_tokens = completion if completion is not None else reader.content_chunks
        record.e2e_s = (ended - sent) * scale
        times = reader.token_times
        if not self.stream and record.ok:
            record.ttft_s = record.e2e_s
        elif times:
            record.ttft_s = (times[0] - sent) * scale
            record.itl_s = [(b - a) * scale for a, b in zip(times, times[1:], strict=False)]
            if record.ok and record.output_tokens > 1:
                record.tpot_s = (record.e2e_s - record.ttft_s) / (record.output_tokens - 1)
        return record

    async def report_progress(self, total: int) -> None:
        tty = sys.stderr.isatty()
        every = PROGRESS_EVERY_S if tty else PROGRESS_EVERY_S_NO_TTY
        try:
            while True:
                await asyncio.sleep(every)
                self._progress_line(total, "\r" if tty else "", "" if tty else "\n")
        finally:
            self._progress_line(total, "\r" if tty else "", "\n")

    def _progress_line(self, total: int, lead: str, end: str) -> None:
        elapsed = now() - self.start
        done = f"{self.done}/{total} done, {self.errors} errors"
        sys.stderr.write(f"{lead}loadtest: {done}, {elapsed:.1f} s elapsed{end}")
        sys.stderr.flush()


async def run_load(
    target: str,
    requests: Sequence[WorkRequest],
    *,
    model: str | None = None,
    time_scale: float = 1.0,
    max_concurrency: int = 1024,
    timeout_s: float = 300.0,
    progress: bool = True,
    stream: bool = True,
) -> tuple[list[RequestRecord], dict[str, Any]]:
    """Send `requests` open-loop; returns their records (by index) and the run's meta.

    `model` None asks for the first model the target lists. Raises TargetError, having sent
    nothing, when the target does not answer at all; any later failure becomes a record.
    """
    if time_scale <= 0 or max_concurrency < 1 or timeout_s <= 0:
        raise ValueError("time_scale and timeout_s must be positive, max_concurrency at least 1")
    target = target.rstrip("/")
    schedule = sorted(requests, key=lambda r: (r.arrival_s, r.index))
    connector = aiohttp.TCPConnector(limit=max_concurrency, limit_per_host=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None)
    ) as http:
        _, models = await _probe(http, target, "/v1/models")
        # Servers that front several models (kvlb, vLLM) refuse a request that names none.
        model = model or _first_model(models)
        run = _Run(http, target, model, time_scale, max_concurrency, timeout_s, stream)
        reporter = asyncio.create_task(run.report_progress(len(schedule))) if progress else None
        tasks: list[asyncio.Task[RequestRecord]] = []
        try:
            for req in schedule:
                # Against the run's start, not the previous send, so sleep errors do not add up.
                due = run.start + req.arrival_s / time_scale
                # Built before its due time: a long prompt takes milliseconds to build, which
                # would otherwise delay this send and stall the streams being read meanwhile.
                body = run.body(req)
                # Timers may fire up to a millisecond early (see `now`): wait out the rest.
                while (delay := due - now()) > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(run.send(req, body, due)))
            records = list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            if reporter is not None:
                reporter.cancel()
                await asyncio.gather(reporter, return_exceptions=True)
        ended = now()
    if run.cap_hits:
        print(
            f"warning: {run.cap_hits} request(s) waited for the concurrency cap "
            f"({max_concurrency}), so they left later than their arrival time",
            file=sys.stderr,
        )
    records.sort(key=lambda r: r.index)
    meta = {
        "duration_s": (ended - run.start) * time_scale,
        "time_scale": time_scale,
        "concurrency_cap_hits": run.cap_hits,
        "max_send_lag_s": run.max_send_lag_s,
        "model": model,
    }
    return records, meta


# -- the command ---------------------------------------------------------------------------

HELP = "send a workload open-loop to an OpenAI-compatible target and summarize latencies"


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be a positive number, not {text!r}")
        return value

    return parse


def _time_scale_arg(text: str) -> float | None:
    return None if text == "auto" else _positive(float)(text)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("loadtest", help=HELP, description=HELP)
    parser.add_argument("--target", required=True, metavar="URL", help="e.g. http://127.0.0.1:8000")
    parser.add_argument("--workload", required=True, metavar="SPEC", help="workload spec")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR",
                        help="where requests.jsonl and summary.json go")  # fmt: skip
    parser.add_argument("--model", help="model to ask for (default: the target's first)")
    parser.add_argument("--time-scale", type=_time_scale_arg, default=None, metavar="auto|S",
                        help="the target's speed-up; auto: from /get_server_info")  # fmt: skip
    parser.add_argument("--max-concurrency", type=_positive(int), default=1024, metavar="N")
    parser.add_argument("--timeout-s", type=_positive(float), default=300.0, metavar="S",
                        help="deadline of each request, real seconds")  # fmt: skip
    parser.add_argument("--no-stream", dest="stream", action="store_false")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    parser.set_defaults(func=main)


def _fail(message: str, code: int) -> int:
    print(f"kvlb loadtest: {message}", file=sys.stderr)
    return code


def main(args: argparse.Namespace) -> int:
    # Imported here so that `kvlb` itself starts even where the workloads module cannot load.
    from loadtest.client.workloads import WorkloadError, load_workload

    if not args.target.startswith(("http://", "https://")):
        return _fail(f"--target must be an http:// or https:// URL, not {args.target!r}", 2)
    try:
        workload = load_workload(args.workload)
    except WorkloadError as exc:
        return _fail(f"bad workload: {exc}", 2)
    for warning in workload.warnings:
        print(f"kvlb loadtest: warning: {warning}", file=sys.stderr)
    import uvloop

    try:
        return uvloop.run(_command(args, workload))
    except KeyboardInterrupt:
        return _fail("interrupted; no results written", 130)


async def _command(args: argparse.Namespace, workload: Any) -> int:
    target = args.target.rstrip("/")
    try:
        scale = args.time_scale
        if scale is None:
            scale, note = await detect_time_scale(target)
            note = note or f"time scale {scale:g}, from the target"
            print(f"kvlb loadtest: {note}", file=sys.stderr)
        records, run_meta = await run_load(
            target, workload.requests, model=args.model, time_scale=scale,
            max_concurrency=args.max_concurrency, timeout_s=args.timeout_s,
            progress=args.progress, stream=args.stream,
        )  # fmt: skip
    except TargetError as exc:
        return _fail(str(exc), 1)
    meta = {
        "workload": workload.spec,
        "workload_description": workload.description,
        "target": target,
        "seed": workload.seed,
        "stream": args.stream,
        **{k: v for k, v in run_meta.items() if k != "duration_s"},
    }
    summary = summarize(records, run_meta["duration_s"], meta=meta)
    write_results(args.out, records, summary)
    print(format_summary(summary))
    print(f"results: {args.out / 'summary.json'}, {args.out / 'requests.jsonl'}")
    if records and summary["errors"] == len(records):
        return _fail(f"every request failed ({error_digest(summary)})", 1)
    return 0
