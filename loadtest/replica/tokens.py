"""Tokenization for the simulated replica: one token per whitespace-separated word.

A real tokenizer would cost more CPU than the rest of the replica together and would tie the
test bed to one model's vocabulary. Counting words keeps the two things routing cares about:
token counts the load generator can predict (N words are N tokens) and shared prefixes that
stay shared.

Chat template. Messages are flattened in order, each as its role marker followed by its
content words, and the prompt ends with the assistant marker that asks for a reply:

    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    -> <|system|> Be brief. <|user|> Hi there <|assistant|>

So a message list costs (its words) + (number of messages) + 1 tokens, and two requests that
share a system prompt or earlier turns share a token prefix. The filler reply of one turn,
sent back as the assistant message of the next, continues the same token sequence the engine
cached while generating it, as on a real engine.

`input_ids` (token ids) are taken as the words of their decimal spelling, so id 42 and the
word "42" are the same token. The way back, `word_token_id`, is what `/tokenize` and the KV
events report: a numeral below 2**31 in its canonical spelling is its own id, any other word
a 32-bit hash with the top bit set, so the two kinds never meet.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import xxhash

# Seed of the first block's hash: the hash of block i covers blocks 0..i, because each block
# is hashed with its parent's hash as the seed.
ROOT_HASH = 0

# Numerals below this are their own token id; hashed words have this bit set.
NUMERAL_ID_LIMIT = 1 << 31

# The filler the engine "generates"; words only, so a reply re-tokenizes to the same count.
FILLER_WORDS: tuple[str, ...] = (
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while",
    "seven", "wizards", "quietly", "box", "jumbled", "vexing", "quartz", "glyphs",
)  # fmt: skip


class PromptError(ValueError):
    """The request's prompt cannot be turned into tokens; the server answers 400."""


def role_marker(role: str) -> str:
    return f"<|{role}|>"


def text_tokens(text: str) -> list[str]:
    return text.split()


def id_tokens(ids: Sequence[Any]) -> list[str]:
    tokens = []
    for token_id in ids:
        # bool is an int in Python but never a token id.
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
            raise PromptError("token ids must be non-negative integers")
        tokens.append(str(token_id))
    return tokens


def word_token_id(word: str) -> int:
    """The uint32 id of one token word, inverse of `id_tokens` for ids below 2**31."""
    # Only the canonical spelling is a numeral: "007" is another word than "7" to the block
    # hashes, so it must be another id too.
    if word.isdigit() and word.isascii() and len(word) <= 10 and (word[0] != "0" or len(word) == 1):
        value = int(word)
        if value < NUMERAL_ID_LIMIT:
            return value
    return xxhash.xxh32_intdigest(word) | NUMERAL_ID_LIMIT


def token_ids(tokens: Sequence[str]) -> list[int]:
    return [word_token_id(word) for word in tokens]


def _content_words(content: Any) -> list[str]:
    if content is None:  # an assistant turn that only called tools
        return []
    if isinstance(content, str):
        return content.split()
    if isinstance(content, list):
        words: list[str] = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise PromptError("only text content parts are supported")
            text = part.get("text")
            if not isinstance(text, str):
                raise PromptError("a text content part needs a string 'text'")
            words.extend(text.split())
        return words
    raise PromptError("message content must be a string or a list of text parts")


def chat_tokens(messages: Any) -> list[str]:
    """Flatten chat messages by the template in this module's docstring."""
    if not isinstance(messages, list) or not messages:
        raise PromptError("'messages' must be a non-empty list")
    tokens: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            raise PromptError("each message must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise PromptError("each message needs a string 'role'")
        tokens.append(role_marker(role))
        tokens.extend(_content_words(message.get("content")))
    tokens.append(role_marker("assistant"))
    return tokens


def block_hashes(
    tokens: Sequence[str], block_size: int, first_block: int = 0, parent: int = ROOT_HASH
) -> list[int]:
    """Chained hashes of the full blocks of `tokens` from block `first_block` on.

    `parent` must be the hash of block `first_block - 1` (ROOT_HASH for block 0); a trailing
    partial block has no hash, as in vLLM, because it can still grow.
    """
    hashes = []
    end = len(tokens) - block_size
    for start in range(first_block * block_size, end + 1, block_size):
        parent = chain_hash(tokens[start : start + block_size], parent)
        hashes.append(parent)
    return hashes


def adapter_root(adapter: str | None) -> int:
    """The parent hash of a sequence's first block: ROOT_HASH for the base model, a hash of
    the name for a LoRA adapter. vLLM keys block hashes by LoRA, so one prompt under two
    adapters, or under an adapter and the base model, must share no cached block."""
    if adapter is None:
        return ROOT_HASH
    # The newline keeps the seed apart from every block's own hash: a block's text is its
    # words joined by spaces and never holds one.
    return xxhash.xxh3_64_intdigest("lora\n" + adapter)


def chain_hash(block: Sequence[str], parent: int) -> int:
    """The hash of one full block of tokens whose parent block hashes to `parent`."""
    # xxhash hashes a str as its UTF-8 bytes, without a copy to bytes first.
    return xxhash.xxh3_64_intdigest(" ".join(block), seed=parent)


def output_word(index: int) -> str:
    return FILLER_WORDS[index % len(FILLER_WORDS)]


def output_piece(index: int) -> str:
    """Text of generated token `index` as streamed: words joined by single spaces."""
    word = FILLER_WORDS[index % len(FILLER_WORDS)]
    return word if index == 0 else " " + word


def output_text(count: int) -> str:
    return " ".join(output_word(i) for i in range(count))
