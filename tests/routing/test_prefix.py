"""Prompt → chained block hashes (balancer/routing/prefix.py)."""

from __future__ import annotations

from array import array

import pytest
from xxhash import xxh3_64_intdigest

from balancer.routing.prefix import _TOKEN_IDS_SEED, PrefixHasher

hasher = PrefixHasher()  # 64 characters, 16 ids, 0.25 tokens per character


def text(*blocks: str) -> str:
    """One 64-character block per argument (each a short tag, padded)."""
    return "".join(tag.ljust(64, ".") for tag in blocks)


def reference(data: str | bytes, unit: int, seed: int = 0) -> list[int]:
    """The scheme spelled out: each whole block hashed with the previous hash as seed."""
    hashes, h = [], seed
    for start in range(0, len(data) // unit * unit, unit):
        block = data[start:start + unit]
        h = xxh3_64_intdigest(block.encode() if isinstance(block, str) else block, h)
        hashes.append(h)
    return hashes


@pytest.mark.parametrize("length", [0, 63, 64, 7 * 64, 8 * 64 + 1, 37 * 64 + 5, 300 * 64])
def test_hashes_follow_the_reference_scheme(length):
    ascii_text = "".join(f"{i} words " for i in range(length))[:length]
    mixed = "".join(f"{i}é漢 " for i in range(length))[:length]
    for prompt in (ascii_text, mixed, ascii_text[:length // 2] + mixed[length // 2:]):
        assert hasher.hashes(prompt) == reference(prompt, 64)
        lazy = hasher.lazy(prompt)
        assert [lazy[i] for i in range(len(lazy))] == reference(prompt, 64)
    ids = [(i * 7919) % 150_000 for i in range(length)]
    assert hasher.token_id_hashes(ids) == reference(array("I", ids).tobytes(), 64,
                                                    _TOKEN_IDS_SEED)


def test_each_hash_chains_the_block_onto_the_previous_hash():
    prompt = text("a", "b", "c")
    h0 = xxh3_64_intdigest(prompt[:64].encode(), 0)
    h1 = xxh3_64_intdigest(prompt[64:128].encode(), h0)
    h2 = xxh3_64_intdigest(prompt[128:].encode(), h1)
    assert hasher.hashes(prompt) == [h0, h1, h2]


def test_equal_prefixes_give_equal_leading_hashes():
    a = hasher.hashes(text("system", "user 1", "answer", "user 2"))
    b = hasher.hashes(text("system", "user 1", "other answer", "user 2"))
    assert a[:2] == b[:2]
    assert a[2] != b[2]
    # Same block 3 content, different history: the chain keeps them apart.
    assert a[3] != b[3]


def test_a_change_in_block_k_changes_hashes_k_onward_only():
    original = text(*"abcdef")
    changed = original[:2 * 64 + 5] + "X" + original[2 * 64 + 6:]
    a, b = hasher.hashes(original), hasher.hashes(changed)
    assert len(a) == len(b) == 6
    assert a[:2] == b[:2]
    assert all(x != y for x, y in zip(a[2:], b[2:], strict=True))


def test_only_whole_blocks_count():
    whole = text("a", "b")
    assert hasher.hashes(whole[:63]) == []
    assert hasher.hashes(whole + "partial") == hasher.hashes(whole)
    assert hasher.hashes(whole + "x" * 63) == hasher.hashes(whole)
    assert len(hasher.hashes(whole + "x" * 64)) == 3


def test_blocks_count_characters_and_a_block_hashes_the_same_in_any_text():
    ascii_head = text("system", "rules")
    accented = "é" * 64 + "漢字" * 32
    mixed = hasher.hashes(ascii_head + accented + "tail")
    assert len(mixed) == 4  # 64 characters a block, though é and 漢 take 2 and 3 bytes
    assert mixed[:2] == hasher.hashes(ascii_head + text("plain"))[:2]
    assert mixed[2] == xxh3_64_intdigest(("é" * 64).encode(), mixed[1])


def test_lone_surrogates_hash_instead_of_failing():
    assert len(hasher.hashes("\ud800" * 64)) == 1


def test_lazy_hashes_compute_only_what_is_read():
    prompt = text(*(str(i) for i in range(100)))
    lazy = hasher.lazy(prompt)
    assert len(lazy) == 100 and lazy.computed == 0
    eager = hasher.hashes(prompt)
    assert lazy[9] == eager[9]
    assert lazy.computed == 16  # the smallest step
    assert lazy[:20] == eager[:20] and lazy.computed == 32  # then doubling
    assert lazy[-1] == eager[-1] and lazy.computed == 100
    assert list(lazy) == eager
    with pytest.raises(IndexError):
        lazy[100]


def test_lazy_hashes_of_mixed_text_match_in_any_reading_order():
    prompt = text("a", "b") + "ü" * 64 + text("c", "d") + "ß" * 130
    eager = hasher.hashes(prompt)
    lazy = hasher.lazy(prompt)
    assert [lazy[i] for i in (0, 3, 1, 6, 2)] == [eager[i] for i in (0, 3, 1, 6, 2)]
    assert lazy.all() == eager and len(eager) == 7


def test_token_ids_hash_by_blocks_of_block_tokens():
    ids = list(range(1000, 1040))
    hashes = hasher.token_id_hashes(ids)
    assert len(hashes) == 2  # 40 ids: two whole blocks of 16
    assert hashes == hasher.token_id_hashes(ids[:32])
    assert hasher.token_id_hashes(ids[:32] + [7] * 16)[:2] == hashes
    assert hasher.token_id_hashes([9] + ids[1:])[0] != hashes[0]
    assert hasher.token_id_hashes(array("I", ids)) == hashes
    assert PrefixHasher(block_tokens=8).token_id_hashes(ids)[1] != hashes[1]


def test_token_ids_and_text_with_the_same_bytes_do_not_collide():
    ids = [0x61616161] * 16  # the bytes of "a" * 64
    assert hasher.token_id_hashes(ids) != hasher.hashes("a" * 64)


@pytest.mark.parametrize("bad", [[-1] * 16, [2**32] * 16, ["1"] * 16])
def test_invalid_token_ids_raise_value_error(bad):
    with pytest.raises(ValueError):
        hasher.token_id_hashes(bad)


def test_estimates_are_in_tokens():
    assert hasher.estimate_tokens("x" * 4000) == 1000
    assert hasher.estimate_tokens("") == 0
    assert hasher.estimate_tokens("x" * 7) == 2  # nearest, not floor
    assert hasher.tokens_per_block == 16
    custom = PrefixHasher(block_chars=32, tokens_per_char=0.3)
    assert custom.tokens_per_block == pytest.approx(9.6)
    assert custom.estimate_tokens("x" * 10) == 3
    assert len(custom.hashes("x" * 100)) == 3


@pytest.mark.parametrize("kwargs", [{"block_chars": 0}, {"block_tokens": 0},
                                    {"tokens_per_char": 0}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        PrefixHasher(**kwargs)
