"""Prefill/decode disaggregation: one request's half, in SGLang's protocol or vLLM's.

SGLang (`--disaggregation-mode prefill|decode`): the router sends the same body to a prefill
and a decode server at once, with `bootstrap_host`, `bootstrap_port` and `bootstrap_room`
added. The prefill half runs as a 1-token request and holds the prompt's KV under the room;
the decode half fetches the room from the prefill server's bootstrap server (waiting for it:
it may ask first), waits out the transfer, and decodes.

vLLM (`--kv-transfer-config`, both roles on one server, as its kv_both): the prefill leg
carries `kv_transfer_params.do_remote_decode` and answers, besides its 1-token completion,
the `kv_transfer_params` that name the held KV (engine id, block ids, side-channel address);
the router passes them on with the decode leg, which fetches and decodes as above.

Held KV is only its token counts (`handoff.py`); the side channel is `bootstrap.py`. A decode
half that cannot get its KV answers 503, so a router can retry with another pair.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import aiohttp
import orjson
from yarl import URL

from loadtest.replica.handoff import HandoffTable, HeldKv, TransferCounters
from loadtest.replica.parsing import ApiError, GenerationRequest, bad_request
from loadtest.replica.profiles import get_profile

if TYPE_CHECKING:
    from loadtest.replica.config import ReplicaConfig

TABLE_CAPACITY = 4096  # prompts held at once; the oldest are dropped beyond
MAX_ROOM = 2**63 - 1
# Beyond the wait asked of the prefill side: connecting, and reading its answer.
FETCH_SLACK_S = 1.0
MAX_WAIT_S = 600.0  # the longest wait the bootstrap server grants one fetch
PREFILL, DECODE = "prefill", "decode"
SGLANG, VLLM = "sglang", "vllm"
BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


@dataclass(frozen=True, slots=True)
class Leg:
    """A request's half of a disaggregated exchange."""

    role: str  # PREFILL or DECODE
    protocol: str  # SGLANG or VLLM
    room: int | None = None  # SGLang's bootstrap room
    host: str = ""  # decode: the prefill server's side channel
    port: int = 0
    engine_id: str = ""  # vLLM decode: the prefill engine and the blocks it holds
    blocks: tuple[int, ...] = ()

    def describe(self) -> str:
        what = f"bootstrap room {self.room}" if self.protocol == SGLANG else "KV transfer"
        return f"{what} on the prefill server {self.host}:{self.port}"


class FetchFailed(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason  # one of handoff.DECODE_FAILURES


class KvHandoff:
    """This replica's part in disaggregation: which half a request is, the KV it holds as a
    prefill server, and fetching KV as a decode server."""

    def __init__(self, config: ReplicaConfig) -> None:
        self.mode = config.disaggregation_mode
        self.vllm = config.kv_transfer_config is not None
        self.wait_s = config.disaggregation_wait_s
        self.gbps = config.kv_transfer_gbps
        self.time_scale = config.time_scale
        self.block_size = config.block_size
        self.profile = get_profile(config.profile)
        self.counters = TransferCounters()
        ttl_s = config.kv_transfer_ttl_s / config.time_scale
        self.rooms = HandoffTable(TABLE_CAPACITY, ttl_s, self.counters)
        self.transfers = HandoffTable(TABLE_CAPACITY, ttl_s, self.counters)
        self.engine_id = str(uuid.uuid4())  # vLLM's remote_engine_id for this replica
        # Where decode replicas reach this one's side channel (the port once it listens).
        self.advertised_host = _advertised(config.host)
        self.bootstrap_port: int | None = None
        self._block_ids = itertools.count(1)
        self._session: aiohttp.ClientSession | None = None

    # -- which half a request is ---------------------------------------------------------

    def leg(self, data: dict[str, Any], generation: GenerationRequest) -> Leg | None:
        """The request's half, checked (ApiError 400); None for a whole request."""
        params = data.get("kv_transfer_params")
        if params is not None:
            if not self.vllm:
                raise bad_request(
                    "'kv_transfer_params' needs a replica started with --kv-transfer-config",
                    param="kv_transfer_params",
                )
            return _vllm_leg(params, generation)
        if self.mode == PREFILL:
            return Leg(PREFILL, SGLANG, room=_room(data))
        if self.mode == DECODE:
            missing = [key for key in BOOTSTRAP_FIELDS if data.get(key) is None]
            if missing:
                raise bad_request(
                    f"a decode server needs {', '.join(missing)} (from the router)",
                    param=missing[0],
                    code="missing_required_parameter",
                )
            host = data["bootstrap_host"]
            if not isinstance(host, str) or not host:
                raise bad_request("'bootstrap_host' must be a host name", param="bootstrap_host")
            port = _port(data["bootstrap_port"], "bootstrap_port", "bootstrap_port")
            return Leg(DECODE, SGLANG, room=_room(data), host=host, port=port)
        return None

    # -- prefill side --------------------------------------------------------------------

    def hold(self, leg: Leg, prompt_tokens: int, cached_tokens: int) -> dict[str, Any] | None:
        """The prefill half is done: hold its KV for the decode side. For vLLM, returns the
        `kv_transfer_params` its answer carries."""
        if leg.protocol == SGLANG:
            self.rooms.put(leg.room, prompt_tokens, cached_tokens)
            return None
        count = max(1, -(-prompt_tokens // self.block_size))
        blocks = [next(self._block_ids) for _ in range(count)]
        self.transfers.put(tuple(blocks), prompt_tokens, cached_tokens)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_block_ids": blocks,
            "remote_host": self.advertised_host,
            "remote_port": self.bootstrap_port,
            "tp_size": 1,
        }

    # -- decode side ---------------------------------------------------------------------

    async def receive(self, leg: Leg) -> HeldKv:
        """Fetch the prompt's KV from the prefill side and wait out its transfer; a 503 in
        the OpenAI shape when that fails."""
        try:
            held = await self._fetch(leg)
        except FetchFailed as failure:
            self.counters.fail(failure.reason)
            raise ApiError(
                503,
                f"{leg.describe()}: {failure}",
                "kv_transfer_failed",
                type_="service_unavailable_error",
            ) from None
        seconds = self.profile.kv_transfer_seconds(held.prompt_tokens, self.gbps)
        await asyncio.sleep(seconds / self.time_scale)
        self.counters.received += 1
        return held

    async def _fetch(self, leg: Leg) -> HeldKv:
        if leg.protocol == SGLANG:
            wait_s = min(self.wait_s, MAX_WAIT_S)
            path = f"/kvlb/rooms/{leg.room}"
            query = f"wait_s={wait_s:g}"
        else:
            # The prefill answer came first, so the KV is held already: no waiting.
            wait_s = 0.0
            path = f"/kvlb/transfers/{quote(leg.engine_id, safe='')}"
            query = "blocks=" + ",".join(map(str, leg.blocks)) + "&wait_s=0"
        host = f"[{leg.host}]" if ":" in leg.host else leg.host
        session = self._client()
        try:
            url = URL(f"http://{host}:{leg.port}{path}?{query}", encoded=True)
            timeout = aiohttp.ClientTimeout(total=wait_s + FETCH_SLACK_S)
            async with session.get(url, timeout=timeout) as response:
                body = await response.read()
                status = response.status
        except TimeoutError:
            raise FetchFailed("timeout", f"no answer within {wait_s + FETCH_SLACK_S:g} s") from None
        except (aiohttp.ClientConnectionError, aiohttp.InvalidURL, ValueError) as error:
            raise FetchFailed("unreachable", f"unreachable ({error})") from None
        except aiohttp.ClientError as error:
            raise FetchFailed("bad_answer", f"bad answer ({error})") from None
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            data = None
        if status == 404 and isinstance(data, dict) and "error" in data:
            raise FetchFailed("not_found", f"unknown after waiting {wait_s:g} s")
        if status != 200:
            # A bare 404 too: that port is not a bootstrap server's.
            raise FetchFailed("bad_answer", f"answered HTTP {status}, not the KV")
        try:
            prompt_tokens, cached_tokens = data["prompt_tokens"], data["cached_tokens"]
        except (KeyError, TypeError):
            raise FetchFailed("bad_answer", "answered no token counts") from None
        if not all(isinstance(n, int) and n >= 0 for n in (prompt_tokens, cached_tokens)):
            raise FetchFailed("bad_answer", "answered no token counts")
        return HeldKv(prompt_tokens, cached_tokens, ready=True)

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            # No connection limit: each waiting fetch holds one connection, and a decode
            # replica under load has more in flight than aiohttp's default 100.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _vllm_leg(params: Any, generation: GenerationRequest) -> Leg | None:
    where = "kv_transfer_params"
    if not isinstance(params, dict):
        raise bad_request("'kv_transfer_params' must be an object", param=where)
    if generation.route == "generate":
        raise bad_request(
            "'kv_transfer_params' is for /v1/completions and /v1/chat/completions", param=where
        )
    if params.get("do_remote_decode"):
        if generation.stream:
            raise bad_request(
                "a prefill leg (do_remote_decode) must not stream: its answer carries "
                "kv_transfer_params",
                param="stream",
            )
        return Leg(PREFILL, VLLM)
    if not params.get("do_remote_prefill"):
        return None  # neither half: served whole, as vLLM does
    engine_id = params.get("remote_engine_id")
    blocks = params.get("remote_block_ids")
    host = params.get("remote_host")
    if not isinstance(engine_id, str) or not engine_id:
        raise bad_request("'remote_engine_id' must be a string", param=where)
    if (
        not isinstance(blocks, list)
        or not blocks
        or not all(isinstance(b, int) and not isinstance(b, bool) for b in blocks)
    ):
        raise bad_request("'remote_block_ids' must be a list of block ids", param=where)
    if not isinstance(host, str) or not host:
        raise bad_request("'remote_host' must be a host name", param=where)
    port = _port(params.get("remote_port"), "remote_port", where)
    return Leg(DECODE, VLLM, host=host, port=port, engine_id=engine_id, blocks=tuple(blocks))


def _room(data: dict[str, Any]) -> int:
    room = data.get("bootstrap_room")
    if room is None:
        raise bad_request(
            "a prefill server needs 'bootstrap_room' (from the router)",
            param="bootstrap_room",
            code="missing_required_parameter",
        )
    if isinstance(room, list):
        raise bad_request(
            "a list of bootstrap rooms (a batch) is not supported", param="bootstrap_room"
        )
    if not isinstance(room, int) or isinstance(room, bool) or not 0 <= room <= MAX_ROOM:
        raise bad_request(
            "'bootstrap_room' must be an integer from 0 to 2**63-1", param="bootstrap_room"
        )
    return room


def _port(value: Any, name: str, param: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 65536:
        raise bad_request(f"'{name}' must be a port number", param=param)
    return value


def _advertised(host: str) -> str:
    """A wildcard listens on every address; decode replicas are told the loopback one."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
