"""Tokens per character, learned per model from the replicas' counts, and what it prices."""

from __future__ import annotations

import pytest

from balancer.config import ReplicaSettings, RoutingSettings
from balancer.routing.fleet import Replica
from balancer.routing.token_ratio import MAX_MODELS, MIN_CHARS, TokenRatio
from balancer.routing.tracker import CacheTracker


def teach(ratio: TokenRatio, model: str, per_char: float, answers: int, chars: int = 5000) -> float:
    learned = ratio.of(model)
    for _ in range(answers):
        learned = ratio.observe(model, chars, round(chars * per_char))
    return learned


def test_a_model_starts_at_the_configured_ratio_and_converges_to_its_tokenizers() -> None:
    ratio = TokenRatio(0.25)
    assert ratio.of("m") == 0.25
    # Text at 7 characters a token, as a tokenizer with long words gives.
    assert teach(ratio, "m", 1 / 7, 60) == pytest.approx(1 / 7, rel=0.03)
    assert ratio.models() == {"m": pytest.approx(1 / 7, rel=0.03)}


def test_models_learn_apart() -> None:
    ratio = TokenRatio(0.25)
    teach(ratio, "code", 0.4, 60)
    teach(ratio, "prose", 0.2, 60)
    assert ratio.of("code") == pytest.approx(0.4, rel=0.03)
    assert ratio.of("prose") == pytest.approx(0.2, rel=0.03)
    assert ratio.of("never-answered") == 0.25


def test_one_garbled_count_moves_the_estimate_little() -> None:
    ratio = TokenRatio(0.25)
    teach(ratio, "m", 0.25, 40)
    after = ratio.observe("m", 5000, 5_000_000)  # a thousand times the truth
    assert 0.25 < after < 0.25 * 1.1


def test_short_prompts_and_empty_counts_teach_nothing() -> None:
    ratio = TokenRatio(0.25)
    ratio.observe("m", MIN_CHARS - 1, 60)
    ratio.observe("m", 5000, 0)
    assert ratio.models() == {}


def test_learning_can_be_turned_off() -> None:
    ratio = TokenRatio(0.3, learn=False)
    assert teach(ratio, "m", 0.1, 60) == 0.3


def test_models_taught_stay_bounded() -> None:
    ratio = TokenRatio(0.25)
    for n in range(MAX_MODELS + 10):
        ratio.observe(f"m{n}", 1000, 100)
    assert len(ratio.models()) == MAX_MODELS
    assert "m0" not in ratio.models() and f"m{MAX_MODELS + 9}" in ratio.models()


def test_bad_start_is_refused() -> None:
    with pytest.raises(ValueError):
        TokenRatio(0.0)


# -- the tracker prices text prompts and text blocks with the learned ratio ----------------


def words(tag: int, n: int) -> str:
    # Seven characters a word with its space, each word one token to a word-counting replica.
    return " ".join(f"{tag:03d}{i:03d}" for i in range(n))


def tracker(capacity_tokens: int | None = None) -> tuple[CacheTracker, Replica]:
    cache = CacheTracker(RoutingSettings(), clock=lambda: 0.0)
    replica = Replica(ReplicaSettings(url="http://127.0.0.1:1", name="r", model="m", kv_capacity_tokens=capacity_tokens))
    cache.index.set_capacity("r", capacity_tokens)
    return cache, replica


def serve(cache: CacheTracker, replica: Replica, prompt: str, model: str = "m") -> None:
    routed = cache.predict(prompt, model)
    cache.start(routed, replica)
    cache.learn(routed, replica, len(prompt.split()), 0)
    cache.finish(routed, replica, answered=True, prefilled=True)


def test_a_learned_ratio_prices_the_next_prompt_in_the_replicas_tokens() -> None:
    cache, replica = tracker()
    probe = words(999, 1000)
    assert cache.predict(probe, "m").prompt_tokens == pytest.approx(len(probe) * 0.25, rel=0.01)
    for n in range(60):
        serve(cache, replica, words(n, 1000))
    assert cache.predict(probe, "m").prompt_tokens == pytest.approx(1000, rel=0.05)
    # The configured ratio still prices a model nobody has answered for.
    assert cache.predict(probe, "other").prompt_tokens == pytest.approx(len(probe) * 0.25, rel=0.01)


def test_a_replicas_cache_holds_as_many_blocks_as_its_tokens_allow() -> None:
    # 20,000 tokens of KV cache. At the configured 0.25 tokens per character a 64-character
    # block would be 16 tokens (1,250 blocks); this text is 7 characters a token, so a block
    # is about 9 tokens and the replica really holds about 2,200 blocks.
    cache, replica = tracker(capacity_tokens=20_000)
    for n in range(60):
        serve(cache, replica, words(n, 1000))
    held = cache.index.entries_of("r")
    per_block = cache.index.block_tokens_of("r")
    assert per_block == pytest.approx(64 / 7, rel=0.05)
    assert held * per_block <= 20_000
    assert held > 1_250 * 1.6
    cache.index.check_invariants()
    # What the replica is predicted to hold of a prompt it has just computed is its tokens.
    last = words(59, 1000)
    assert cache.predict(last, "m").cached["r"] == pytest.approx(1000, rel=0.05)


def test_token_id_prompts_are_counted_exactly_and_teach_no_ratio() -> None:
    cache, replica = tracker()
    ids = list(range(1000))
    routed = cache.predict(ids, "m")
    assert routed.prompt_tokens == 1000 and routed.block_tokens == 16
    cache.start(routed, replica)
    cache.learn(routed, replica, 1000, 0)
    assert cache.ratio.models() == {}
    assert cache.predict(ids, "m").cached["r"] == 992  # 62 whole blocks of 16
