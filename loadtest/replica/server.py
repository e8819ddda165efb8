"""The HTTP face of one simulated replica: an aiohttp app around a real-time engine driver.

`ReplicaServer` runs in any asyncio loop (the tests start several in one process); the
command line runs one on uvloop. Routes: the generation routes in `generation.py`, the
information and health routes vLLM and SGLang expose, `/metrics`, `/tokenize` (vLLM's), and `/admin/*`
for fault injection and the simulator's own timing statistics. With a KV events endpoint set,
the prefix cache's changes go out over ZMQ (`kv_events.py`). With LoRA enabled, `/v1/models`
lists the registered adapters and, with runtime updating allowed, vLLM's and SGLang's routes
register and unregister them (`lora.py`). A prefill replica of a disaggregated pair also
runs the bootstrap server decode replicas fetch its KV from (`disaggregation.py`,
`bootstrap.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from typing import Any

import orjson
from aiohttp import web

from loadtest.replica.bootstrap import BootstrapServer
from loadtest.replica.config import ReplicaConfig
from loadtest.replica.disaggregation import KvHandoff
from loadtest.replica.driver import RealtimeDriver
from loadtest.replica.engine import Engine
from loadtest.replica.faults import Faults, FaultSpecError, FaultState
from loadtest.replica.generation import GenerationRoutes, error_response
from loadtest.replica.kv_events import KvEventPublisher
from loadtest.replica.lora import LoraRegistry
from loadtest.replica.metrics import build_registry, render
from loadtest.replica.parsing import ApiError, bad_request, parse_json_object, read_body
from loadtest.replica.tokens import PromptError, chat_tokens, text_tokens, token_ids

log = logging.getLogger("kvlb.replica")

# Long enough for an admin reply to leave before the process dies.
EXIT_GRACE_S = 0.05
# In-flight requests get about this long (aiohttp may wait it twice) to finish on stop; a
# simulator need not drain for a minute.
SHUTDOWN_GRACE_S = 0.5


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(payload), content_type="application/json")


@web.middleware
async def _json_route_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """An unknown route or method answered as the engines' HTTP framework answers it
    (FastAPI's `{"detail": ...}` in JSON), not as aiohttp's plain text."""
    try:
        return await handler(request)
    except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as exc:
        answer = _json({"detail": exc.reason}, exc.status)
        if "Allow" in exc.headers:
            answer.headers["Allow"] = exc.headers["Allow"]
        return answer

class ReplicaServer:
    def __init__(self, config: ReplicaConfig) -> None:
        self.config = config
        self.engine = Engine(config.engine_config())
        self.driver = RealtimeDriver(self.engine, config.time_scale)
        self.faults = FaultState(config.faults)
        self.model = config.model_name
        self.lora = LoraRegistry(self.model, config.lora_modules) if config.enable_lora else None
        # The engines apply adapter loads and unloads one at a time.
        self._lora_updates = asyncio.Lock()
        self.handoff = KvHandoff(config)
        self.registry = build_registry(
            self.driver, self.model, self.handoff.counters if config.disaggregated else None
        )
        self.started_at = int(time.time())
        self.port: int | None = None
        self.kv_events: KvEventPublisher | None = None
        self.bootstrap: BootstrapServer | None = None
        self._runner: web.AppRunner | None = None
        self._exit_handle: asyncio.TimerHandle | None = None
        self.app = self._build_app()

    # -- lifecycle -----------------------------------------------------------------------

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[_json_route_errors])
        GenerationRoutes(self.config, self.driver, self.faults, self.lora, self.handoff).add_to(app)
        router = app.router
        # As vLLM, which mounts these only with runtime updating allowed: otherwise they are
        # unknown routes (404), not refusals.
        if self.lora is not None and self.config.allow_runtime_lora_updating:
            for prefix in ("/v1", ""):  # vLLM's, then SGLang's
                router.add_post(prefix + "/load_lora_adapter", self.load_lora_adapter)
                router.add_post(prefix + "/unload_lora_adapter", self.unload_lora_adapter)
        router.add_get("/v1/models", self.models)
        router.add_get("/health", self.health)
        router.add_get("/health_generate", self.health)
        router.add_get("/get_server_info", self.server_info)
        router.add_get("/server_info", self.server_info)
        router.add_get("/get_model_info", self.model_info)
        router.add_get("/model_info", self.model_info)
        router.add_get("/get_load", self.load)
        router.add_get("/metrics", self.metrics)
        router.add_post("/tokenize", self.tokenize)
        router.add_post("/flush_cache", self.flush_cache)  # SGLang's name
        router.add_post("/reset_prefix_cache", self.flush_cache)  # vLLM's name
        router.add_get("/admin/fault", self.get_fault)
        router.add_post("/admin/fault", self.set_fault)
        router.add_get("/admin/stats", self.stats)
        router.add_post("/admin/stats/reset", self.reset_stats)
        return app

    async def start(self) -> int:
        """Listen and start the engine loop; returns the port (useful with port 0)."""
        self.driver.start()
        # Without handler cancellation a client that leaves while its request waits in the
        # queue would be noticed only at the first write; the engine would keep its blocks.
        self._runner = web.AppRunner(
            self.app,
            access_log=None,
            handler_cancellation=True,
            shutdown_timeout=SHUTDOWN_GRACE_S,
        )
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET6 if ":" in self.config.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.config.host, self.config.port))
            # After the HTTP port is ours: a caller retrying taken ports must not also
            # rebind the events endpoint each time.
            self._start_kv_events()
        except Exception:
            sock.close()
            raise
        site = web.SockSite(self._runner, sock, backlog=1024)
        await site.start()
        self.port = sock.getsockname()[1]
        # After the HTTP port is ours, for the reason above; a taken bootstrap port then
        # fails with `port` set, and launch.py does not retry that with another HTTP port.
        await self._start_bootstrap()
        self._schedule_exit(self.faults.faults.exit_after_s)
        return self.port

    async def stop(self) -> None:
        if self._exit_handle is not None:
            self._exit_handle.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.bootstrap is not None:
            await self.bootstrap.stop()
            self.bootstrap = None
        await self.handoff.close()
        await self.driver.stop()
        self._stop_kv_events()

    async def _start_bootstrap(self) -> None:
        config = self.config
        if not config.serves_kv:
            return
        bootstrap = BootstrapServer(self.handoff, config.host, config.disaggregation_bootstrap_port)
        self.bootstrap = bootstrap
        port = await bootstrap.start()
        self.handoff.bootstrap_port = port
        log.info("bootstrap server (KV side channel) on http://%s:%d", config.host, port)

    @property
    def bootstrap_port(self) -> int | None:
        """The real port of the bootstrap server; None when this replica runs none."""
        return self.handoff.bootstrap_port

    def _start_kv_events(self) -> None:
        config = self.config
        if config.kv_events_endpoint is None:
            return
        publisher = KvEventPublisher(
            config.kv_events_endpoint,
            config.kv_events_topic,
            config.kv_events_encoding,
            lora_ids=self.lora.lora_id if self.lora is not None else None,
        )
        self.kv_events = publisher
        self.engine.set_cache_listener(publisher)
        self.driver.on_iteration_end = publisher.flush

    def _stop_kv_events(self) -> None:
        publisher = self.kv_events
        if publisher is None:
            return
        self.engine.set_cache_listener(None)
        self.driver.on_iteration_end = None
        publisher.close()
        self.kv_events = None

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def _schedule_exit(self, after_s: float | None) -> None:
        if self._exit_handle is not None:
            self._exit_handle.cancel()
            self._exit_handle = None
        if after_s is not None:
            loop = asyncio.get_running_loop()
            self._exit_handle = loop.call_later(max(after_s, EXIT_GRACE_S), _crash)

    # -- information ---------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        cards: list[dict[str, Any]] = [
            {
                "id": self.model,
                "object": "model",
                "created": self.started_at,
                "owned_by": "kvlb",
                "root": self.model,
                "parent": None,
                "max_model_len": self.engine.max_sequence_tokens,
            }
        ]
        # vLLM's adapter cards: the path as the root, the base model as the parent.
        for adapter in self.lora or ():
            cards.append(
                {
                    "id": adapter.name,
                    "object": "model",
                    "created": adapter.created,
                    "owned_by": "kvlb",
                    "root": adapter.path,
                    "parent": adapter.base_model_name or self.model,
                    "max_model_len": None,
                }
            )
        return _json({"object": "list", "data": cards})

    async def health(self, request: web.Request) -> web.Response:
        if self.faults.faults.unhealthy or not self.driver.running:
            return web.Response(status=503, text="unhealthy")
        return web.Response(status=200)

    def server_info_body(self) -> dict[str, Any]:
        engine_config = self.engine.config
        profile = self.engine.profile
        return {
            "simulator": "kvlb-replica",
            "model": self.model,
            "served_model_name": self.model,
            "model_path": self.model,
            "profile": profile.name,
            "kv_capacity_tokens": self.engine.cache.capacity_tokens,
            "max_total_num_tokens": self.engine.cache.capacity_tokens,
            "block_size": engine_config.block_size,
            "page_size": engine_config.block_size,
            "time_scale": self.config.time_scale,
            "max_running_requests": engine_config.max_running,
            "max_batched_tokens": engine_config.max_batched_tokens,
            "chunked_prefill_size": engine_config.max_batched_tokens,
            "max_waiting_requests": engine_config.max_waiting,
            "context_length": self.engine.max_sequence_tokens,
            "max_model_len": self.engine.max_sequence_tokens,
            "default_max_tokens": self.config.default_max_tokens,
            "tokenizer": "whitespace",
            "kv_events_endpoint": self.config.kv_events_endpoint,
            "kv_events_topic": self.config.kv_events_topic,
            "kv_events_encoding": self.config.kv_events_encoding,
            "max_loras": engine_config.max_loras,
            "max_loras_per_batch": engine_config.max_loras,  # SGLang's name for it
            "max_loaded_loras": self.config.max_loaded_loras,
            "disaggregation_mode": self.config.disaggregation_mode,
            "disaggregation_bootstrap_port": self.bootstrap_port,
            "kv_transfer_config": _kv_transfer_config(self.config),
            "kv_transfer_gbps": self.config.kv_transfer_gbps,
            "kv_bytes_per_token": profile.kv_bytes_per_token,
            "engine_id": self.handoff.engine_id,
            "timing_ms": {
                "a": profile.a_ms,
                "b": profile.b_ms_per_token,
                "k": profile.k_ms_per_token2,
                "d0": profile.d0_ms,
                "d1": profile.d1_ms_per_seq,
                "d2": profile.d2_ms_per_ctx_token,
            },
        }

    async def server_info(self, request: web.Request) -> web.Response:
        return _json(self.server_info_body())

    async def model_info(self, request: web.Request) -> web.Response:
        return _json(
            {
                "model_path": self.model,
                "tokenizer_path": None,
                "is_generation": True,
                "served_model_name": self.model,
            }
        )

    async def load(self, request: web.Request) -> web.Response:
        # SGLang's sum: KV tokens in use plus the prompts still waiting.
        engine = self.engine
        used_tokens = engine.cache.used_blocks * engine.block_size
        return _json(
            [
                {
                    "dp_rank": 0,
                    "num_tokens": used_tokens + engine.waiting_tokens,
                    "num_reqs": engine.num_running + engine.num_waiting,
                    "num_waiting_reqs": engine.num_waiting,
                }
            ]
        )

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=render(self.registry), headers={"Content-Type": "text/plain; version=0.0.4"}
        )

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await read_body(request, self.config.max_body_bytes)
            data = parse_json_object(body)
            tokens = tokenize_words(data)
        except ApiError as error:
            return error_response(error)
        answer: dict[str, Any] = {
            "count": len(tokens),
            "max_model_len": self.engine.max_sequence_tokens,
            "tokens": token_ids(tokens),
        }
        if data.get("return_token_strs"):
            answer["token_strs"] = tokens
        return _json(answer)

    async def flush_cache(self, request: web.Request) -> web.Response:
        self.engine.clear_cache()
        if self.kv_events is not None:
            self.kv_events.flush()  # now, not at the next iteration's end: the engine may idle
        return web.Response(status=200, text="cache flushed")

    # -- administration ------------------------------------------------------------------

    async def get_fault(self, request: web.Request) -> web.Response:
        return _json(self.faults.faults.to_json())

    async def set_fault(self, request: web.Request) -> web.Response:
        try:
            body = await request.read()
            spec = parse_json_object(body) if body.strip() else {}
            try:
                faults = Faults.from_json(spec)
            except FaultSpecError as error:
                raise bad_request(str(error)) from None
        except ApiError as error:
            return error_response(error)
        self.faults.replace(faults)
        self._schedule_exit(faults.exit_after_s)
        log.warning("faults now %s", faults.to_json())
        return _json(faults.to_json())

    async def stats(self, request: web.Request) -> web.Response:
        counters = self.engine.counters
        body = self.driver.stats()
        body["engine"] = {
            "iterations": counters.iterations,
            "requests_finished": counters.requests_finished,
            "requests_aborted": counters.requests_aborted,
            "preemptions": counters.preemptions,
            "prompt_tokens": counters.prefix_queries_tokens,
            "cached_prompt_tokens": counters.prefix_hits_tokens,
            "prefill_tokens": counters.prompt_tokens,  # computed here, not found or copied
            "transferred_tokens": counters.transferred_tokens,
            "generation_tokens": counters.generation_tokens,
            "evicted_blocks": self.engine.cache.evicted_blocks_total,
            "kv_usage": self.engine.cache.usage,
            "running": self.engine.num_running,
            "waiting": self.engine.num_waiting,
            "lora_loads": counters.lora_loads,
            "lora_evictions": counters.lora_evictions,
            "resident_adapters": self.engine.resident_adapters(),
        }
        body["kv_events"] = self.kv_events.stats() if self.kv_events is not None else None
        body["kv_transfers"] = self.handoff.counters.to_json()
        return _json(body)

    async def reset_stats(self, request: web.Request) -> web.Response:
        self.driver.reset_stats()
        return web.Response(status=200)

    # -- LoRA adapters at run time -------------------------------------------------------

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        assert self.lora is not None
        try:
            data = parse_json_object(await read_body(request, self.config.max_body_bytes))
            name, path = data.get("lora_name"), data.get("lora_path")
            if not name or not path or not isinstance(name, str) or not isinstance(path, str):
                raise _invalid_lora("Both 'lora_name' and 'lora_path' must be provided.")
            async with self._lora_updates:
                cap = self.config.max_loaded_loras
                if cap is not None and name not in self.lora and len(self.lora) >= cap:
                    return _registry_full(request.path, name, path, cap)
                if name not in self.lora and self.config.lora_register_ms > 0:
                    # Reading the weights from disk.
                    await asyncio.sleep(self.config.lora_register_ms / 1000 / self.config.time_scale)
                try:
                    self.lora.register(name, path)
                except ValueError as error:
                    raise _invalid_lora(str(error)) from None
        except ApiError as error:
            return error_response(error)
        log.info("LoRA adapter %s registered from %s", name, path)
        return web.Response(status=200, text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        assert self.lora is not None
        try:
            data = parse_json_object(await read_body(request, self.config.max_body_bytes))
            name = data.get("lora_name")
            if not name or not isinstance(name, str):
                raise _invalid_lora("'lora_name' needs to be provided to unload a LoRA adapter.")
            try:
                async with self._lora_updates:
                    self.lora.unregister(name)
            except KeyError:
                message = f"The lora adapter '{name}' cannot be found."
                raise ApiError(404, message, 404, type_="NotFoundError") from None
        except ApiError as error:
            return error_response(error)
        self.engine.drop_adapter(name)
        log.info("LoRA adapter %s unregistered", name)
        return web.Response(
            status=200, text=f"Success: LoRA adapter '{name}' removed successfully."
        )


def tokenize_words(data: dict[str, Any]) -> list[str]:
    """The tokens of a vLLM `/tokenize` body: a `prompt` text as the completion routes read
    it, or `messages` through the chat route's template."""
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", param="model")
    # Accepted for vLLM's clients; the whitespace tokenizer has no special tokens to add and
    # its chat template always ends with the generation prompt.
    for key in ("add_special_tokens", "add_generation_prompt", "return_token_strs"):
        value = data.get(key)
        if value is not None and not isinstance(value, bool):
            raise bad_request(f"'{key}' must be a boolean", param=key)
    has_prompt = "prompt" in data
    if has_prompt == ("messages" in data):
        raise bad_request(
            "give exactly one of 'prompt' and 'messages'",
            param="prompt",
            code="invalid_value" if has_prompt else "missing_required_parameter",
        )
    if has_prompt:
        prompt = data["prompt"]
        if not isinstance(prompt, str):
            raise bad_request("'prompt' must be a string", param="prompt")
        return text_tokens(prompt)
    try:
        return chat_tokens(data["messages"])
    except PromptError as error:
        raise bad_request(str(error), param="messages") from None


def _kv_transfer_config(config: ReplicaConfig) -> dict[str, str] | None:
    kv = config.kv_transfer_config
    return None if kv is None else {"kv_connector": kv.kv_connector, "kv_role": kv.kv_role}


def _registry_full(route: str, name: str, path: str, cap: int) -> web.Response:
    """SGLang's refusal of a load past `--max-loaded-loras`: its message, in its own answer
    shape on its route, in vLLM's error shape on vLLM's."""
    message = (
        f"Cannot load LoRA adapter {name} at path {path}. Maximum number of loaded LoRA "
        f"adapters is {cap}. Please unload some LoRA adapters before loading new ones."
    )
    if route.startswith("/v1/"):
        return error_response(_invalid_lora(message))
    return _json({"success": False, "error_message": message, "loaded_adapters": None}, 400)


def _invalid_lora(message: str) -> ApiError:
    # vLLM's messages, type and status code for a bad load or unload request.
    return ApiError(400, message, 400, type_="InvalidUserInput")


def _crash() -> None:
    log.warning("injected fault: exiting")
    with contextlib.suppress(Exception):
        logging.shutdown()
    os._exit(1)
