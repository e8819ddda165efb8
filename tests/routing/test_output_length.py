"""Expected output, learned from answers that ended on their own."""

from __future__ import annotations

import pytest

from balancer.routing.output_length import MAX_KEYS, OutputLengths
from policies.base import RequestFeatures
from policies.registry import make_policy

CHAT = "/v1/chat/completions"


def test_nothing_is_expected_before_a_few_answers_have_ended() -> None:
    lengths = OutputLengths()
    assert lengths.expect("m", CHAT, 1000) is None
    lengths.observe("m", CHAT, 1000, 40, None)
    assert lengths.expect("m", CHAT, 1000) is None
    for _ in range(4):
        lengths.observe("m", CHAT, 1000, 40, None)
    assert lengths.expect("m", CHAT, 1000) == pytest.approx(40)


def test_answers_cut_at_max_tokens_teach_nothing() -> None:
    lengths = OutputLengths()
    for _ in range(10):
        lengths.observe("m", CHAT, 1000, 64, 64)  # stopped by its bound, not by the model
    assert lengths.expect("m", CHAT, 1000) is None
    for _ in range(10):
        lengths.observe("m", CHAT, 1000, 30, 64)  # ended on its own below the bound
    assert lengths.expect("m", CHAT, 1000) == pytest.approx(30)


def test_prompt_length_buckets_fall_back_to_the_route() -> None:
    lengths = OutputLengths()
    for _ in range(20):
        lengths.observe("m", CHAT, 100, 500, None)  # short prompts, long answers
        lengths.observe("m", CHAT, 20_000, 20, None)  # long documents, short answers
    assert lengths.expect("m", CHAT, 120) == pytest.approx(500, rel=0.01)
    assert lengths.expect("m", CHAT, 24_000) == pytest.approx(20, rel=0.01)
    # A length nobody sent yet gets the route's mean; another model or route gets nothing.
    assert 20 < lengths.expect("m", CHAT, 3000) < 500
    assert lengths.expect("other", CHAT, 120) is None
    assert lengths.expect("m", "/v1/completions", 120) is None


def test_a_change_of_traffic_is_followed() -> None:
    lengths = OutputLengths()
    for _ in range(50):
        lengths.observe("m", CHAT, 100, 400, None)
    for _ in range(30):
        lengths.observe("m", CHAT, 100, 40, None)
    assert lengths.expect("m", CHAT, 100) < 150  # most of the way within a few dozen
    for _ in range(70):
        lengths.observe("m", CHAT, 100, 40, None)
    assert lengths.expect("m", CHAT, 100) == pytest.approx(40, rel=0.1)


def test_keys_stay_bounded() -> None:
    lengths = OutputLengths()
    for n in range(MAX_KEYS):
        lengths.observe(f"m{n}", CHAT, 100, 10, None)
    assert len(lengths) == MAX_KEYS


def test_the_policy_prices_the_learned_output_within_max_tokens() -> None:
    policy = make_policy("predictive")
    base = RequestFeatures(route=CHAT, prompt_tokens=1000)
    assert policy.expected_output(base) == 256  # default_output_tokens
    learned = RequestFeatures(route=CHAT, prompt_tokens=1000, expected_output_tokens=40.0)
    assert policy.expected_output(learned) == 40
    bounded = RequestFeatures(route=CHAT, prompt_tokens=1000, expected_output_tokens=40.0, max_tokens=8)
    assert policy.expected_output(bounded) == 8
    assert policy.expected_output(RequestFeatures(route=CHAT, max_tokens=100)) == 100
