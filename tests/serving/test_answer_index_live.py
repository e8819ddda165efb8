"""An answer enters the prefix index after its prompt, on the replica that wrote it: the next
turn of a conversation, which sends it back, is predicted to find it cached there, as the
replica (which caches what it decodes) then reports. Through kvlb, on every route and both
ways of answering."""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any

import aiohttp
import orjson
import pytest

from loadtest.replica.config import ReplicaConfig
from loadtest.replica.launch import running_replica
from loadtest.replica.tokens import FILLER_WORDS
from tests.conftest import make_settings, run_balancer

MODEL = "sim"
ANSWER_TOKENS = 400
# Words like the answer's, so one tokens-per-character ratio prices both alike: the filler
# words' own, set rather than learned, since learning it takes more than two prompts.
TOKENS_PER_CHAR = 0.175
SYSTEM = " ".join(FILLER_WORDS[(7 * i) % len(FILLER_WORDS)] for i in range(80))
QUESTION = "tell me a long story about the sea"
FOLLOW_UP = "and now a shorter one about the mountains please"
CASES = [("/v1/chat/completions", True), ("/v1/chat/completions", False), ("/v1/completions", True),
         ("/v1/completions", False), ("/generate", True), ("/generate", False)]


def body_for(route: str, turn: int, answer: str, stream: bool) -> dict[str, Any]:
    if route == "/v1/chat/completions":
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
        if turn:
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": FOLLOW_UP}]
        body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": ANSWER_TOKENS}
    else:
        # The answer goes on from the prompt's last character: a space, as a model's first
        # word would start with one.
        prompt = SYSTEM + "\n" + QUESTION + " " + ("" if not turn else answer + "\n" + FOLLOW_UP)
        if route == "/generate":
            return {"text": prompt, "sampling_params": {"max_new_tokens": ANSWER_TOKENS}, "stream": stream}
        body = {"model": MODEL, "prompt": prompt, "max_tokens": ANSWER_TOKENS}
    body["stream"] = stream
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def text_and_cached(route: str, raw: bytes, stream: bool) -> tuple[str, int]:
    """The answer's text and the replica's own count of cached prompt tokens."""
    events = ([orjson.loads(line[5:]) for line in raw.split(b"\n")
               if line.startswith(b"data:") and line[5:].strip() != b"[DONE]"] if stream else [orjson.loads(raw)])
    if route == "/generate":
        return events[-1]["text"], events[-1]["meta_info"]["cached_tokens"]
    parts = []
    for event in events:
        for choice in event.get("choices") or ():
            if route == "/v1/completions":
                parts.append(choice["text"])
            else:
                parts.append((choice.get("delta") or choice.get("message") or {}).get("content") or "")
    usage = next(e["usage"] for e in reversed(events) if e.get("usage"))
    return "".join(parts), usage["prompt_tokens_details"]["cached_tokens"]


def predicted_cached(route_header: str) -> float:
    chosen = route_header.split(";")[0].split()
    return dict(part.split("=", 1) for part in chosen[1:]).get("cached", 0.0)


async def two_turns(route: str, stream: bool, routing: dict[str, Any]) -> tuple[str, float, int]:
    """The first answer, then the second turn's predicted and reported cached tokens."""
    async with AsyncExitStack() as stack:
        server = await stack.enter_async_context(running_replica(ReplicaConfig(model=MODEL, time_scale=200)))
        settings = make_settings([{"url": f"http://127.0.0.1:{server.port}", "name": "r0"}],
                                 policy={"name": "cache_aware"}, routing={"route_header": True, "tokens_per_char": TOKENS_PER_CHAR,
                                          "learn_tokens_per_char": False, **routing})
        running = await stack.enter_async_context(run_balancer(settings))
        answer = ""
        async with aiohttp.ClientSession() as http:
            for turn in range(2):
                async with http.post(running.url + route, json=body_for(route, turn, answer, stream)) as resp:
                    raw = await resp.read()
                    assert resp.status == 200, raw
                    header = resp.headers["x-kvlb-route"]
                text, cached = text_and_cached(route, raw, stream)
                if turn == 0:
                    answer = text
            async with http.get(running.url + "/metrics") as resp:
                metrics = await resp.text()
        shares = [float(line.split()[-1]) for line in metrics.splitlines()
                  if line.startswith("kvlb_answer_return_share ")]
        # Two answers recorded, the first sent back, the second not yet: under 1.
        assert shares == [] if routing.get("index_answer_chars") == 0 else 0.5 < shares[0] < 1.0, shares
        return answer, float(predicted_cached(header)), cached


@pytest.mark.parametrize(("route", "stream"), CASES)
async def test_the_next_turn_is_predicted_to_find_the_answer_cached(route: str, stream: bool) -> None:
    answer, predicted, reported = await two_turns(route, stream, {})
    assert len(answer.split()) >= ANSWER_TOKENS // 2  # a long answer, most of what follows
    # The replica kept its answer: most of the second prompt came from cache...
    assert reported > ANSWER_TOKENS
    # ...and kvlb predicted as much, in its own token estimate.
    assert 0.8 * reported <= predicted <= 1.2 * reported, (predicted, reported)


async def test_without_answers_in_the_index_only_the_prompt_is_predicted() -> None:
    _, predicted, reported = await two_turns("/v1/chat/completions", True, {"index_answer_chars": 0})
    assert reported > ANSWER_TOKENS
    assert predicted < 0.5 * reported, (predicted, reported)


async def test_only_the_first_characters_of_a_long_answer_are_kept() -> None:
    _, whole, reported = await two_turns("/v1/chat/completions", True, {})
    _, cut, _ = await two_turns("/v1/chat/completions", True, {"index_answer_chars": 400})
    # 400 characters are about 100 tokens of the answer's ANSWER_TOKENS.
    assert cut < whole - ANSWER_TOKENS // 2, (cut, whole, reported)
    assert cut > 0
