"""The side channel through which decode replicas fetch a prefill replica's KV.

SGLang's prefill server runs a bootstrap server beside its HTTP one (port 8998 by default)
where decode servers look up a room's KV; vLLM's NIXL connector has a side channel of its
own. A prefill replica (`--disaggregation-mode prefill`, or `--kv-transfer-config`) runs
this small HTTP server on its bootstrap port, same host as its main server:

- `GET /kvlb/rooms/{room}?wait_s=S`: waits up to S real seconds (default 30) for the
  room's prefill to finish, then answers `{"room", "prompt_tokens", "cached_tokens"}` and
  forgets the room; 404 if it is still unknown when the wait ends.
- `GET /kvlb/transfers/{engine_id}?blocks=1,2,3&wait_s=S`: the same for the blocks of a
  vLLM transfer (no wait by default: the prefill answer named them, so they are held);
  404 for another engine's id or blocks it does not hold.
- `GET /health`.

Errors are JSON in the OpenAI shape, as the replica's other routes answer them.
"""

from __future__ import annotations

import socket
from typing import Any

import orjson
from aiohttp import web

from loadtest.replica.disaggregation import MAX_ROOM, MAX_WAIT_S, KvHandoff
from loadtest.replica.parsing import ApiError, bad_request

ROOM_WAIT_S = 30.0
SHUTDOWN_GRACE_S = 0.5


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(payload), content_type="application/json")


def _error(error: ApiError) -> web.Response:
    return web.Response(status=error.status, body=error.body(), content_type="application/json")


def _not_found(message: str) -> ApiError:
    return ApiError(404, message, "not_found", type_="NotFoundError")


def _wait_s(request: web.Request, default: float) -> float:
    text = request.query.get("wait_s")
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= MAX_WAIT_S:  # also refuses nan
        raise bad_request(f"'wait_s' must be a number of seconds up to {MAX_WAIT_S:g}", "wait_s")
    return value


class BootstrapServer:
    def __init__(self, handoff: KvHandoff, host: str, port: int) -> None:
        self.handoff = handoff
        self.host = host
        self.requested_port = port  # 0: any free port
        self.port: int | None = None
        self._runner: web.AppRunner | None = None

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/kvlb/rooms/{room}", self.room)
        app.router.add_get("/kvlb/transfers/{engine_id}", self.transfer)
        app.router.add_get("/health", self.health)
        return app

    async def start(self) -> int:
        # Handler cancellation ends a waiting fetch whose decode replica has given up.
        runner = web.AppRunner(
            self._app(),
            access_log=None,
            handler_cancellation=True,
            shutdown_timeout=SHUTDOWN_GRACE_S,
        )
        await runner.setup()
        self._runner = runner
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.requested_port))
        except OSError as error:
            sock.close()
            # Named, so a launcher retrying taken HTTP ports can tell this one apart.
            raise OSError(
                error.errno, f"bootstrap port {self.requested_port}: {error.strerror}"
            ) from None
        except Exception:
            sock.close()
            raise
        await web.SockSite(runner, sock, backlog=1024).start()
        self.port = sock.getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def room(self, request: web.Request) -> web.Response:
        try:
            text = request.match_info["room"]
            room = int(text) if text.isascii() and text.isdigit() else -1
            if not 0 <= room <= MAX_ROOM:
                raise bad_request("the room must be an integer from 0 to 2**63-1", "room")
            wait_s = _wait_s(request, ROOM_WAIT_S)
            held = await self.handoff.rooms.take(room, wait_s)
            if held is None:
                raise _not_found(f"bootstrap room {room} is unknown here after {wait_s:g} s")
        except ApiError as error:
            return _error(error)
        return _json(
            {"room": room, "prompt_tokens": held.prompt_tokens, "cached_tokens": held.cached_tokens}
        )

    async def transfer(self, request: web.Request) -> web.Response:
        try:
            engine_id = request.match_info["engine_id"]
            try:
                blocks = tuple(int(b) for b in request.query.get("blocks", "").split(","))
            except ValueError:
                raise bad_request("'blocks' must be comma-separated block ids", "blocks") from None
            wait_s = _wait_s(request, 0.0)
            held = None
            if engine_id == self.handoff.engine_id:
                held = await self.handoff.transfers.take(blocks, wait_s)
            if held is None:
                raise _not_found(
                    f"no KV held for engine {engine_id} blocks {list(blocks)} "
                    "(unknown, expired or fetched already)"
                )
        except ApiError as error:
            return _error(error)
        return _json(
            {
                "engine_id": engine_id,
                "blocks": list(blocks),
                "prompt_tokens": held.prompt_tokens,
                "cached_tokens": held.cached_tokens,
            }
        )
