"""The engine in virtual time against the calibrated profile's spot values and scheduling rules."""

import pytest

from loadtest.replica.engine import (
    ContextLengthError,
    Engine,
    EngineConfig,
    QueueFullError,
    Status,
    run_until_idle,
)
from loadtest.replica.profiles import PROFILES, get_profile
from loadtest.replica.tokens import chat_tokens, output_text

H100 = get_profile("llama-3.1-8b-h100")
TOLERANCE = 0.15


def words(prefix: str, count: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(count)]


def engine(**overrides) -> Engine:
    return Engine(EngineConfig(profile=overrides.pop("profile", H100), **overrides))


def ttft_ms(seq) -> float:
    return (seq.first_token_time - seq.arrival_time) * 1000


def assert_near(measured: float, expected: float) -> None:
    assert abs(measured - expected) <= TOLERANCE * expected, (measured, expected)


@pytest.mark.parametrize(
    ("prompt", "expected_ms"), [(1024, 24), (2048, 47), (4096, 95), (8192, 198), (16384, 430)]
)
def test_single_prefill_matches_calibration(prompt, expected_ms):
    (seq,), iterations, _ = run_until_idle(engine(), [(0.0, words("w", prompt), 1)])
    assert_near(ttft_ms(seq), expected_ms)
    # Chunked prefill: 16k tokens take two iterations of at most max_batched_tokens.
    assert len(iterations) == -(-prompt // 8192)
    assert all(it.prefill_tokens <= 8192 for it in iterations)


def test_prefill_on_top_of_cache_matches_calibration():
    shared = words("s", 4096)
    seqs, _, _ = run_until_idle(
        engine(), [(0.0, shared + words("a", 4096), 1), (10.0, shared + words("b", 4096), 1)]
    )
    assert seqs[1].cached_tokens == 4096
    assert_near(ttft_ms(seqs[1]), 107)


def test_shared_prefix_reports_whole_cached_blocks_and_shortens_ttft():
    shared = words("s", 4096 + 7)  # 4,096 tokens in whole blocks, 7 in a partial one
    first, second = run_until_idle(
        engine(), [(0.0, shared + words("a", 1000), 4), (5.0, shared + words("b", 1000), 4)]
    )[0]
    assert first.cached_tokens == 0
    assert second.cached_tokens == 4096
    assert ttft_ms(second) < 0.5 * ttft_ms(first)
    assert_near(ttft_ms(second), H100.prefill_ms(1007, 4096))


def test_decode_step_at_batch_one():
    _, iterations, _ = run_until_idle(engine(), [(0.0, words("w", 1024), 5)])
    decode_ms = [it.duration * 1000 for it in iterations[1:]]
    assert len(decode_ms) == 4
    for ms in decode_ms:
        assert_near(ms, 8.4)


@pytest.mark.parametrize(("context", "expected_ms"), [(2048, 14.6), (8192, 31.7)])
def test_64_concurrent_decodes_advance_together(context, expected_ms):
    # 64 sequences of 8k do not fit the H100 profile's 440k tokens; the spot value assumes
    # they do, so give this engine room. Prompts are prefilled a chunk at a time, so the
    # first ones decode beside later prefills; once all are in, all 64 move in lockstep.
    arrivals = [(0.0, words(f"r{n}-", context - 1), 100) for n in range(64)]
    seqs, iterations, _ = run_until_idle(engine(kv_capacity_tokens=2_000_000), arrivals)
    lockstep = [it for it in iterations if it.prefill_tokens == 0 and it.decode_seqs == 64]
    assert len(lockstep) >= 30
    assert all(len(it.emitted) == 64 for it in lockstep)  # one token each, every iteration
    assert_near(lockstep[0].duration * 1000, expected_ms)
    assert all(seq.num_generated == 100 for seq in seqs)


def test_full_kv_cache_makes_requests_wait_not_fail():
    # Room for one 600-token request and its output, not for two.
    eng = engine(kv_capacity_tokens=1024)
    a = eng.submit(words("a", 600), 200, 0.0)
    b = eng.submit(words("b", 600), 10, 0.0)
    eng.step(0.0)
    assert a.status is Status.RUNNING
    assert b.status is Status.WAITING
    seqs, _, _ = run_until_idle(eng, start=eng.busy_until)
    assert a.status is Status.FINISHED and b.status is Status.FINISHED
    assert b.first_token_time >= a.finish_time
    assert b.num_generated == 10


def test_eviction_under_pressure_never_touches_running_blocks():
    eng = engine(kv_capacity_tokens=16 * 100)
    holder = eng.submit(words("hold", 320), 400, 0.0)  # runs through the whole test
    now = 0.0
    submitted = 0
    while submitted < 12:
        iteration = eng.step(now)
        now = iteration.end
        if not holder.in_prefill and submitted == eng.counters.requests_finished:
            eng.submit(words(f"p{submitted}-", 320), 2, now)  # one short request at a time
            submitted += 1
        held = holder.hashes[: holder.num_shared]
        assert all(eng.cache.ref_count(block) >= 1 for block in held)
    # Twelve finished prompts of 20 blocks each cannot all stay in 100 blocks.
    assert eng.cache.evicted_blocks_total > 0
    assert holder.status is Status.RUNNING
    assert holder.num_shared > 20  # its decode blocks are cached and held too


def test_no_eviction_below_capacity():
    eng = engine(kv_capacity_tokens=16 * 1000)
    arrivals = [(float(n), words(f"p{n}-", 320), 4) for n in range(20)]
    run_until_idle(eng, arrivals)
    assert eng.cache.evicted_blocks_total == 0
    assert eng.cache.cached_blocks == 20 * 20


def test_preemption_recomputes_and_still_finishes():
    # Two sequences whose outputs outgrow the cache together: one is preempted and resumed.
    eng = engine(kv_capacity_tokens=16 * 40)
    arrivals = [(0.0, words("a", 200), 200), (0.0, words("b", 200), 200)]
    seqs, _, _ = run_until_idle(eng, arrivals)
    assert eng.counters.preemptions >= 1
    assert [seq.num_generated for seq in seqs] == [200, 200]
    assert seqs[1].tokens[200:] == output_text(200).split()
    assert eng.cache.used_blocks == 0


def test_generated_tokens_are_cached_for_the_next_turn():
    first_turn = [{"role": "user", "content": " ".join(words("q", 300))}]
    eng = engine()
    (first,), _, now = run_until_idle(eng, [(0.0, chat_tokens(first_turn), 64)])
    second_turn = first_turn + [
        {"role": "assistant", "content": output_text(64)},
        {"role": "user", "content": "and then?"},
    ]
    (second,), _, _ = run_until_idle(eng, [(now + 1, chat_tokens(second_turn), 4)], start=now)
    # Prompt and reply (minus the last, never computed, token) in whole blocks.
    assert second.cached_tokens == (first.prompt_tokens + 64 - 1) // 16 * 16


def test_chunked_prefill_budget_and_max_running():
    eng = engine(max_running=2, max_batched_tokens=4096)
    arrivals = [(0.0, words(f"r{n}-", 5000), 3) for n in range(3)]
    _, iterations, _ = run_until_idle(eng, arrivals)
    assert all(it.prefill_tokens <= 4096 for it in iterations)
    assert max(it.decode_seqs for it in iterations) <= 2


def test_abort_releases_blocks_in_any_state():
    eng = engine(max_running=1)
    running = eng.submit(words("a", 100), 50, 0.0)
    waiting = eng.submit(words("b", 100), 50, 0.0)
    iteration = eng.step(0.0)
    assert eng.cache.used_blocks > 0
    eng.abort(waiting)
    eng.abort(running)
    assert eng.cache.used_blocks == 0
    assert not eng.has_work
    assert eng.next_step_time() is None
    assert iteration.end > 0


def test_bounds():
    eng = engine(max_waiting=2, context_limit=1000)
    eng.submit(words("a", 10), 1, 0.0)
    eng.submit(words("b", 10), 1, 0.0)
    with pytest.raises(QueueFullError):
        eng.submit(words("c", 10), 1, 0.0)
    with pytest.raises(ContextLengthError):
        engine(context_limit=1000).submit(words("d", 990), 11, 0.0)
    with pytest.raises(ContextLengthError):
        engine(kv_capacity_tokens=512).submit(words("e", 600), 1, 0.0)


def test_step_before_the_last_iteration_ends_is_refused():
    eng = engine()
    eng.submit(words("a", 100), 5, 0.0)
    iteration = eng.step(0.0)
    with pytest.raises(ValueError):
        eng.step(iteration.end / 2)


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_profile_runs(name):
    seqs, _, _ = run_until_idle(engine(profile=PROFILES[name]), [(0.0, words("w", 3000), 8)])
    assert seqs[0].num_generated == 8 and ttft_ms(seqs[0]) > 0
