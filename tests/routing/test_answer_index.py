"""An answer recorded after its prompt: what the next turn matches, and where it never does."""

from __future__ import annotations

from balancer.config import ReplicaSettings, RoutingSettings
from balancer.routing.answer_returns import MIN_RETURN_SHARE
from balancer.routing.fleet import Replica
from balancer.routing.request import answer_continuation, canonical_prompt
from balancer.routing.tracker import CacheTracker

CHAT = "/v1/chat/completions"
SYSTEM = "You are a patient tutor who explains physics with care. " * 20
ANSWER = "Light bends because its speed changes between materials, and so on. " * 30


def replica(name: str) -> Replica:
    return Replica(ReplicaSettings(url="http://127.0.0.1:1", name=name))


def prompt(*messages: tuple[str, str]) -> str:
    text = canonical_prompt(CHAT, {"messages": [{"role": r, "content": c} for r, c in messages]})
    assert isinstance(text, str)
    return text


FIRST = prompt(("system", SYSTEM), ("user", "Why does light bend?"))
SECOND = prompt(("system", SYSTEM), ("user", "Why does light bend?"), ("assistant", ANSWER),
                ("user", "And sound?"))


def answered(tracker: CacheTracker, where: Replica, text: str, adapter: str | None = None) -> None:
    routed = tracker.predict(text, adapter=adapter)
    tracker.start(routed, where)
    continuation = answer_continuation(CHAT, ANSWER)
    assert continuation is not None
    tracker.record_answer(routed, where, continuation)


def test_the_next_turn_matches_the_answer_on_the_replica_that_wrote_it() -> None:
    tracker = CacheTracker(RoutingSettings(learn_tokens_per_char=False), clock=lambda: 0.0)
    a = replica("a")
    before = tracker.predict(SECOND).cached.get("a", 0)
    answered(tracker, a, FIRST)
    cached = tracker.predict(SECOND).cached
    # Everything up to the follow-up question, to the block: the first prompt and the answer.
    upto = len(FIRST + "\n<|assistant|>" + ANSWER)
    assert cached["a"] == upto // 64 * 16
    assert before == 0 and "b" not in cached
    # The answer alone, after another prompt, matches nothing.
    assert not tracker.predict(prompt(("system", "other"), ("assistant", ANSWER))).cached


def test_an_answer_under_one_adapter_is_not_cached_under_another() -> None:
    tracker = CacheTracker(RoutingSettings(), clock=lambda: 0.0)
    a = replica("a")
    answered(tracker, a, FIRST, adapter="sql")
    deep = tracker.predict(SECOND, adapter="sql").cached["a"]
    assert deep > tracker.hasher.estimate_tokens(FIRST)
    assert not tracker.predict(SECOND, adapter="chat").cached
    assert not tracker.predict(SECOND).cached


def test_peers_hear_of_the_answer_and_token_id_prompts_record_nothing() -> None:
    tracker = CacheTracker(RoutingSettings(), clock=lambda: 0.0)
    heard: list[tuple[str, int]] = []
    tracker.on_record = lambda name, hashes, adapter: heard.append((name, len(hashes)))
    a = replica("a")
    answered(tracker, a, FIRST)
    assert heard == [("a", len(FIRST) // 64), ("a", len(FIRST + "\n<|assistant|>" + ANSWER) // 64)]
    ids = list(range(400))
    routed = tracker.predict(ids)
    tracker.start(routed, a)
    entries = tracker.index.entries
    tracker.record_answer(routed, a, "more text " * 100)
    assert tracker.index.entries == entries


def test_no_answer_characters_no_answer() -> None:
    tracker = CacheTracker(RoutingSettings(index_answer_chars=0), clock=lambda: 0.0)
    a = replica("a")
    answered(tracker, a, FIRST)
    assert tracker.predict(SECOND).cached["a"] == len(FIRST) // 64 * 16
    assert answer_continuation("/v1/embeddings", ANSWER) is None


def test_answers_that_never_come_back_stop_filling_the_index() -> None:
    tracker = CacheTracker(RoutingSettings(), clock=lambda: 0.0)
    a = replica("a")
    recorded = 0
    for n in range(200):  # one-shot questions: no answer is ever sent back
        routed = tracker.predict(f"Question {n}: " + "what is the weather like on the coast? " * 4)
        tracker.start(routed, a)
        before = tracker.index.entries
        tracker.record_answer(routed, a, answer_continuation(CHAT, ANSWER) or "")
        recorded += tracker.index.entries > before
    assert tracker.answer_returns.share < MIN_RETURN_SHARE
    # Recorded while the prior held the share up, then one in EXPLORE_EVERY.
    assert 80 < recorded < 120, recorded


def test_conversations_keep_their_answers_recorded() -> None:
    tracker = CacheTracker(RoutingSettings(), clock=lambda: 0.0)
    a = replica("a")
    for n in range(50):
        history = [("system", f"Conversation {n}. " + SYSTEM), ("user", "Why does light bend?")]
        for turn in range(4):
            text = prompt(*history)
            routed = tracker.predict(text)
            if turn:
                # The previous answer came back: matched through its last block.
                assert routed.cached["a"] >= tracker.hasher.estimate_tokens(text) - 64
            tracker.start(routed, a)
            tracker.record_answer(routed, a, answer_continuation(CHAT, ANSWER) or "")
            history += [("assistant", ANSWER), ("user", f"And part {turn}?")]
    assert tracker.answer_returns.share > 0.7


def test_a_fractional_block_size_keeps_every_predicted_block() -> None:
    # 64 characters at 0.175 tokens each: 11.2 tokens a block, and 7 blocks are 78.4 tokens,
    # predicted as 78.
    tracker = CacheTracker(RoutingSettings(tokens_per_char=0.175, learn_tokens_per_char=False), clock=lambda: 0.0)
    a = replica("a")
    text = "".join(f"{n:063d}\n" for n in range(7))
    tracker.start(tracker.predict(text), a)
    routed = tracker.predict(text + "more")
    assert routed.cached["a"] == 78
    assert routed.blocks(routed.cached["a"]) == 7
    assert routed.demand_key == routed.hashes[6]
