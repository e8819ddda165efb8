"""The three generation routes: OpenAI chat and text completions (vLLM) and `/generate` (SGLang).

Each request is parsed and checked, queued in the engine, then answered from its
`TokenListener`: a stream writes one chunk per token as iterations end, a plain request waits
for the last one. Whatever way the handler leaves (done, client gone, cancelled), the
sequence leaves the engine and its KV blocks are released. With LoRA enabled the request's
`model` (or `/generate`'s `lora_path`) picks the adapter, and a model the replica does not
serve is a 404 before anything is queued (`lora.py`).

A disaggregated half (`disaggregation.py`) changes three things: a prefill half is limited to
one token and holds its KV when that token is out; a decode half first fetches its KV from
the prefill side (a 503 if it cannot) and enters the engine with it resident; and its usage
reports the prefill side's cached tokens, the cache hit a client would have seen.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from loadtest.replica.config import ReplicaConfig
from loadtest.replica.disaggregation import DECODE, PREFILL, KvHandoff, Leg
from loadtest.replica.driver import RealtimeDriver, TokenListener
from loadtest.replica.engine import ContextLengthError, EngineSequence, QueueFullError
from loadtest.replica.faults import FaultState
from loadtest.replica.lora import LoraRegistry
from loadtest.replica.parsing import (
    ApiError,
    GenerationRequest,
    bad_request,
    model_not_found,
    parse_chat,
    parse_completion,
    parse_generate,
    parse_json_object,
    read_body,
)
from loadtest.replica.responses import (
    DONE,
    OpenAIStream,
    SGLangGenerate,
    chat_completion,
    text_completion,
    usage,
)
from loadtest.replica.streaming import SseStream, drop_connection

JSON_TYPE = "application/json"


def error_response(error: ApiError) -> web.Response:
    return web.Response(status=error.status, body=error.body(), content_type=JSON_TYPE)


class PrefillHold:
    """Holds a prefill half's KV once, when its token is out, and keeps what the hold
    returned (vLLM's kv_transfer_params) for the answer."""

    __slots__ = ("_handoff", "_leg", "_held", "params")

    def __init__(self, handoff: KvHandoff, leg: Leg) -> None:
        self._handoff = handoff
        self._leg = leg
        self._held = False
        self.params: dict[str, Any] | None = None

    def __call__(self, prompt_tokens: int, cached_tokens: int) -> dict[str, Any] | None:
        if not self._held:
            self._held = True
            self.params = self._handoff.hold(self._leg, prompt_tokens, cached_tokens)
        return self.params


def service_unavailable(message: str) -> ApiError:
    return ApiError(503, message, "service_unavailable", type_="service_unavailable_error")


class GenerationRoutes:
    def __init__(
        self,
        config: ReplicaConfig,
        driver: RealtimeDriver,
        faults: FaultState,
        lora: LoraRegistry | None = None,
        handoff: KvHandoff | None = None,
    ) -> None:
        self.config = config
        self.driver = driver
        self.faults = faults
        self.lora = lora  # None: LoRA off, and any model name is served by the base model
        self.handoff = handoff or KvHandoff(config)
        self._served_model = config.model_name
        # Short ids, unique per process: the prefix tells two replicas' ids apart.
        self._id_prefix = os.urandom(4).hex()
        self._ids = itertools.count(1)

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/generate", self.generate)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, parse_chat)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, parse_completion)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, parse_generate)

    async def _handle(
        self, request: web.Request, parse: Callable[[dict[str, Any]], GenerationRequest]
    ) -> web.StreamResponse:
        try:
            body = await read_body(request, self.config.max_body_bytes)
            if self.faults.should_reject():
                raise service_unavailable("injected fault: server unavailable")
            await self.faults.hang()
            data = parse_json_object(body)
            generation = parse(data)
            leg = self.handoff.leg(data, generation)
            adapter = self._adapter(generation)
            max_tokens = self._max_tokens(generation)  # checked on both halves alike
            hold = PrefillHold(self.handoff, leg) if leg and leg.role == PREFILL else None
            if hold is not None:
                max_tokens = 1  # the decode server makes the answer
            # The decode half's prompt cost the prefill side's hit, not this cache's.
            cached_override = None
            if leg is not None and leg.role == DECODE:
                cached_override = (await self.handoff.receive(leg)).cached_tokens
            listener = TokenListener(
                every_token=generation.stream or self.faults.faults.cut_after_tokens is not None
            )
            request_id = generation.request_id or f"{self._id_prefix}{next(self._ids):x}"
            try:
                seq = self.driver.submit(
                    generation.tokens,
                    max_tokens,
                    listener,
                    request_id,
                    adapter,
                    kv_transferred=cached_override is not None,
                )
            except QueueFullError as error:
                raise service_unavailable(str(error)) from None
            except ContextLengthError as error:  # pragma: no cover - checked above
                raise ApiError(400, str(error), "context_length_exceeded") from None
        except ApiError as error:
            return error_response(error)
        try:
            if generation.route == "generate":
                return await self._sglang(request, generation, seq, listener, cached_override)
            return await self._openai(request, generation, seq, listener, cached_override, hold)
        finally:
            self.driver.abort(seq)  # a no-op once the sequence has finished
            # Its token is out however the answer ended (a client gone after it still
            # leaves computed KV); a prefill aborted before it holds nothing.
            if hold is not None and listener.done:
                hold(seq.prompt_tokens, seq.cached_tokens)

    def _adapter(self, generation: GenerationRequest) -> str | None:
        """The LoRA adapter the request names; None for the base model."""
        lora = self.lora
        if lora is None:
            return None
        name = generation.lora_path
        if name is not None:
            if name not in lora:
                raise bad_request(f"LoRA adapter '{name}' is not loaded", param="lora_path")
            return name
        try:
            return lora.adapter_for(generation.model)
        except LookupError:
            raise model_not_found(generation.model or "") from None

    def _max_tokens(self, generation: GenerationRequest) -> int:
        """vLLM's rule: an explicit max_tokens must fit; a default shrinks to what is left."""
        limit = self.driver.engine.max_sequence_tokens
        prompt = len(generation.tokens)
        requested = generation.max_tokens
        if requested is None:
            if prompt < limit:
                return min(self.config.default_max_tokens, limit - prompt)
            requested = self.config.default_max_tokens
        if prompt + requested > limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {prompt + requested} tokens ({prompt} in the messages, "
                f"{requested} in the completion). Please reduce the length of the "
                "messages or completion.",
                "context_length_exceeded",
                param="messages" if generation.route == "chat" else "prompt",
            )
        return requested

    def _cut_after_tokens(self) -> int | None:
        return self.faults.faults.cut_after_tokens

    async def _wait_until_done(self, request: web.Request, listener: TokenListener) -> int:
        while True:
            cut = self._cut_after_tokens()
            if cut is not None and listener.delivered >= cut:
                drop_connection(request)
            if listener.done:
                return listener.delivered
            await listener.wait()

    async def _openai(
        self,
        request: web.Request,
        generation: GenerationRequest,
        seq: EngineSequence,
        listener: TokenListener,
        cached_override: int | None = None,
        hold: PrefillHold | None = None,
    ) -> web.StreamResponse:
        chat = generation.route == "chat"
        request_id = ("chatcmpl-" if chat else "cmpl-") + seq.request_id
        created = int(time.time())
        model = generation.model or self._served_model
        if not generation.stream:
            count = await self._wait_until_done(request, listener)
            cached = seq.cached_tokens if cached_override is None else cached_override
            body_usage = usage(seq.prompt_tokens, count, cached)
            # vLLM's prefill leg names the KV it holds in its answer.
            params = hold(seq.prompt_tokens, seq.cached_tokens) if hold is not None else None
            extra = {"kv_transfer_params": params} if params is not None else None
            build = chat_completion if chat else text_completion
            body = build(request_id, created, model, count, body_usage, extra)
            return web.Response(body=body, content_type=JSON_TYPE)

        stream = OpenAIStream(chat, request_id, created, model, seq.max_tokens)
        include_usage = generation.include_usage

        def chunks(first: int, end: int, done: bool) -> list[bytes]:
            parts = [stream.token_chunk(i, done and i == end - 1) for i in range(first, end)]
            if done:
                if include_usage:
                    cached = seq.cached_tokens if cached_override is None else cached_override
                    parts.append(stream.usage_chunk(seq.prompt_tokens, end, cached))
                parts.append(DONE)
            return parts

        return await SseStream(request, listener, chunks, stream.framed_chunk, self.faults).run()

    async def _sglang(
        self,
        request: web.Request,
        generation: GenerationRequest,
        seq: EngineSequence,
        listener: TokenListener,
        cached_override: int | None = None,
    ) -> web.StreamResponse:
        started = time.monotonic()
        answer = SGLangGenerate(seq.request_id, seq.prompt_tokens)

        def cached() -> int:
            # Read once the engine has admitted the request, not at submit.
            return seq.cached_tokens if cached_override is None else cached_override

        if not generation.stream:
            count = await self._wait_until_done(request, listener)
            answer.cached_tokens = cached()
            body = answer.response(count, time.monotonic() - started)
            return web.Response(body=body, content_type=JSON_TYPE)

        def chunks(first: int, end: int, done: bool) -> list[bytes]:
            answer.cached_tokens = cached()
            latency = time.monotonic() - started if done else None
            parts = [
                answer.stream_chunk(i, done and i == end - 1, latency) for i in range(first, end)
            ]
            if done:
                parts.append(DONE)
            return parts

        return await SseStream(request, listener, chunks, answer.framed_chunk, self.faults).run()
