"""Tokenization: N words are N tokens; chat turns flatten into a shared, growing prefix."""

import pytest

from loadtest.replica.tokens import (
    PromptError,
    chat_tokens,
    id_tokens,
    output_piece,
    output_text,
    text_tokens,
)


def test_one_token_per_word():
    assert len(text_tokens("  one two\tthree\nfour  ")) == 4
    assert text_tokens("") == []


def test_chat_template():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi there"}]},
    ]
    assert chat_tokens(messages) == [
        "<|system|>", "Be", "brief.", "<|user|>", "Hi", "there", "<|assistant|>",
    ]  # fmt: skip


def test_conversations_share_their_history_as_a_prefix():
    system = {"role": "system", "content": "You are a helpful assistant " * 50}
    first = [system, {"role": "user", "content": "question one"}]
    reply = {"role": "assistant", "content": output_text(5)}
    second = first + [reply, {"role": "user", "content": "question two"}]
    a, b = chat_tokens(first), chat_tokens(second)
    # The second turn starts with the first prompt followed by the generated reply.
    assert b[: len(a)] == a
    assert b[len(a) : len(a) + 5] == output_text(5).split()


def test_stream_pieces_concatenate_to_the_text():
    assert "".join(output_piece(i) for i in range(40)) == output_text(40)
    assert len(output_text(40).split()) == 40


def test_token_ids_are_words_of_their_digits():
    assert id_tokens([1, 22, 333]) == ["1", "22", "333"]
    with pytest.raises(PromptError):
        id_tokens([1, "2"])
    with pytest.raises(PromptError):
        id_tokens([True])


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hello",
        [{"content": "no role"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        ["not an object"],
    ],
)
def test_bad_messages(messages):
    with pytest.raises(PromptError):
        chat_tokens(messages)
