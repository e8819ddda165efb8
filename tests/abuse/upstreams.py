"""Upstreams that misbehave on purpose, for the abuse suite: tiny HTTP/1.1 servers written
byte by byte, each in a thread with its own event loop, so that they can say things no
well-behaved server would, and keep answering while a test blocks its own loop."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from tests.abuse.harness import READ_LIMIT
from tests.conftest import TEST_PORT_RANGE


@dataclass
class UpstreamRequest:
    method: str
    path: str
    headers: dict[str, str]  # lower-case names
    body: bytes

    @property
    def json(self) -> dict[str, Any]:
        try:
            data = orjson.loads(self.body)
        except orjson.JSONDecodeError:
            return {}
        return data if isinstance(data, dict) else {}


Handler = Callable[[UpstreamRequest, asyncio.StreamWriter], Awaitable[None]]


def response_bytes(status: int, body: bytes, content_type: str = "application/json",
                   headers: Iterable[tuple[str, str]] = (), reason: str = "OK") -> bytes:
    lines = [f"HTTP/1.1 {status} {reason}", f"Content-Type: {content_type}", f"Content-Length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def completion(model: str, content: str = "the quick brown fox") -> bytes:
    return orjson.dumps({
        "id": "chatcmpl-raw", "object": "chat.completion", "created": 0, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
    })


def error_json(status: int) -> bytes:
    return orjson.dumps({"error": {"message": f"upstream says {status}", "type": "server_error",
                                   "param": None, "code": None}})


def chat_handler(chunk_bytes: int = 0) -> Handler:
    """Answers like an engine: JSON, or (`stream`) one SSE event per token of `max_tokens`,
    each padded with `chunk_bytes` of text, written as fast as the reader takes them."""
    pad = "x" * chunk_bytes

    async def handle(request: UpstreamRequest, writer: asyncio.StreamWriter) -> None:
        data = request.json
        model = str(data.get("model", "raw"))
        if not data.get("stream"):
            writer.write(response_bytes(200, completion(model)))
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(int(data.get("max_tokens") or 4)):
            event = orjson.dumps({"id": "chatcmpl-raw", "object": "chat.completion.chunk", "model": model,
                                  "choices": [{"index": 0, "delta": {"content": f" t{i}{pad}"}}]})
            await write_chunk(writer, b"data: " + event + b"\n\n")
        await write_chunk(writer, b"data: [DONE]\n\n")
        writer.write(b"0\r\n\r\n")

    return handle


async def write_chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(b"%x\r\n%b\r\n" % (len(data), data))
    await writer.drain()


def status_handler(status: int) -> Handler:
    async def handle(_request: UpstreamRequest, writer: asyncio.StreamWriter) -> None:
        writer.write(response_bytes(status, error_json(status), reason="Oops"))

    return handle


async def hang(_request: UpstreamRequest, _writer: asyncio.StreamWriter) -> None:
    await asyncio.sleep(3600)


class RawUpstream:
    """An HTTP/1.1 server in a thread of its own, on a free test port of 127.0.0.1.

    /health answers 200 and /v1/models lists `models` (404 when None); every other request
    goes to `handler`, which writes whatever bytes it likes (closing the writer ends the
    connection). `seen` keeps those requests; `active` counts the ones being handled."""

    def __init__(self, handler: Handler | None = None, models: Sequence[str] | None = ("raw-model",)) -> None:
        self.handler = handler or chat_handler()
        self.models = models
        self.seen: list[UpstreamRequest] = []
        self.active = 0
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> RawUpstream:
        loop = self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=loop.run_forever, name=f"raw-upstream-{id(self):x}", daemon=True)
        self._thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._listen(), loop).result(10)
        return self

    async def _listen(self) -> int:
        for _ in range(100):
            port = random.randrange(*TEST_PORT_RANGE)
            try:
                self._server = await asyncio.start_server(self._serve, "127.0.0.1", port, limit=READ_LIMIT)
            except OSError:
                continue
            return port
        raise RuntimeError("no free test port")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        try:
            while (request := await _read_request(reader)) is not None:
                if request.method == "GET" and request.path == "/health":
                    writer.write(response_bytes(200, b'{"status":"ok"}'))
                elif request.method == "GET" and request.path == "/v1/models":
                    if self.models is None:
                        writer.write(response_bytes(404, b'{"detail":"Not Found"}'))
                    else:
                        cards = [{"id": m, "object": "model", "created": 0, "owned_by": "raw"} for m in self.models]
                        writer.write(response_bytes(200, orjson.dumps({"object": "list", "data": cards})))
                else:
                    self.seen.append(request)
                    self.active += 1
                    try:
                        await self.handler(request, writer)
                    finally:
                        self.active -= 1
                if writer.is_closing():
                    break
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # kvlb went away, as it may
        finally:
            self._tasks.discard(task)
            self._writers.discard(writer)
            writer.close()

    def stop(self) -> None:
        loop = self._loop
        if loop is None:
            return
        self._loop = None

        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for writer in list(self._writers):
                writer.transport.abort()
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(close(), loop).result(5)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            assert self._thread is not None
            self._thread.join(5)
            loop.close()


async def _read_request(reader: asyncio.StreamReader) -> UpstreamRequest | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise
        return None
    request_line, *lines = head[:-4].decode("latin-1").split("\r\n")
    method, target, _ = request_line.split(" ", 2)
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return UpstreamRequest(method, target, headers, body)
