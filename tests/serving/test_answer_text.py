"""Reading an answer's text from the bytes that pass through, however the replica cuts them."""

from __future__ import annotations

import orjson

from balancer.serving.answer_text import BATCH_BYTES, LINE_LIMIT, AnswerText

CHAT = "/v1/chat/completions"


def chat_event(text: str | None, index: int = 0) -> bytes:
    delta = {} if text is None else {"content": text}
    return b"data: " + orjson.dumps({"choices": [{"index": index, "delta": delta}]}) + b"\n\n"


def stream_of(pieces: list[str]) -> bytes:
    return (chat_event(None) + b"".join(chat_event(p) for p in pieces)
            + b'data: {"choices":[],"usage":{"prompt_tokens":3}}\n\ndata: [DONE]\n\n')


def test_a_stream_cut_anywhere_reads_the_same() -> None:
    raw = stream_of(["Hello", ", ", "wor\u00e9ld", " \"quoted\"\n"])
    for size in (1, 2, 7, 50, len(raw)):
        answer = AnswerText(CHAT, 1000)
        for start in range(0, len(raw), size):
            answer.feed(raw[start:start + size])
        assert answer.text == 'Hello, wor\u00e9ld "quoted"\n', size


def test_events_written_any_way_read_alike() -> None:
    import json

    answer = AnswerText(CHAT, 1000)
    answer.feed(b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": "spaced "}}]}).encode() + b"\n")
    answer.feed(b'data: {"choices":[{"index":0,"delta":{"reasoning_content":"hmm","content":"after "},'
                b'"logprobs":{"content":[{"token":"x"}]}}]}\n')
    answer.feed(b'data:{"choices":[{"index":0,"delta":{"content":null}}]}\n')
    answer.feed(b'data: {"choices":[{"index":1,"delta":{"content":"other"}},{"index":0,"delta":{"content":"both"}}]}\n')
    assert answer.text == "spaced after both"
    completion = AnswerText("/v1/completions", 1000)
    completion.feed(b'data: {"choices":[{"index":0,"text":"one \\"two\\"","logprobs":null}]}\n\n')
    assert completion.text == 'one "two"'


def test_only_the_first_choice_counts() -> None:
    answer = AnswerText(CHAT, 1000)
    answer.feed(chat_event("a", 0) + chat_event("X", 1) + chat_event("b", 0))
    assert answer.text == "ab"


def test_the_text_is_bounded() -> None:
    answer = AnswerText(CHAT, 10)
    for _ in range(100):
        answer.feed(chat_event("abcd"))
    assert answer.text == "abcdabcdab"
    assert answer._pending == []  # reading stopped once the bound was reached
    answer.feed(chat_event("more"))
    assert answer.text == "abcdabcdab"


def test_an_endless_line_ends_the_reading_not_the_memory() -> None:
    answer = AnswerText(CHAT, 10_000_000)
    answer.feed(chat_event("kept"))
    for _ in range(LINE_LIMIT // 1000 + 2):
        answer.feed(b"x" * 1000)
    assert answer.text == "kept"
    assert answer._pending == []
    answer.feed(chat_event("after"))
    assert answer.text == "kept"


def test_whole_answers_of_each_route() -> None:
    chat = AnswerText(CHAT, 100)
    chat.body(orjson.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}]}))
    assert chat.text == "hi"
    completion = AnswerText("/v1/completions", 100)
    completion.body(orjson.dumps({"choices": [{"index": 0, "text": " there"}]}))
    assert completion.text == " there"
    generate = AnswerText("/generate", 100)
    generate.body(orjson.dumps({"text": "sg", "meta_info": {}}))
    assert generate.text == "sg"


def test_what_is_not_an_answer_reads_as_none() -> None:
    for data in (b"not json", b"[1, 2]", b'{"choices": "x"}', b'{"choices": [{"message": null}]}',
                 b'{"text": ["a", "b"]}'):
        answer = AnswerText(CHAT, 100)
        answer.body(data)
        assert answer.text == ""


def test_a_generate_stream_reads_its_last_whole_event() -> None:
    events = b"".join(b"data: " + orjson.dumps({"text": t, "meta_info": {}}) + b"\n\n"
                      for t in ("a", "ab", "abc")) + b"data: [DONE]\n\n"
    answer = AnswerText("/generate", 100)
    answer.from_last_event(events)
    assert answer.text == "abc"
    cut = AnswerText("/generate", 100)
    cut.from_last_event(events[events.index(b"ab") + 1:])  # starts inside an event
    assert cut.text == "abc"


def test_a_long_stream_reads_whole_in_batches() -> None:
    import random

    rng = random.Random(3)
    pieces = [rng.choice([" word", " caf\u00e9", ' "q"', "\n", " \u4e2d\u6587", "\\", " ok"]) + str(i) for i in range(3000)]
    raw = stream_of(pieces)
    assert len(raw) > 5 * BATCH_BYTES
    answer = AnswerText(CHAT, 10_000_000)
    at = 0
    while at < len(raw):
        size = rng.randrange(1, 700)
        answer.feed(raw[at:at + size])
        at += size
        assert answer._pending_bytes < BATCH_BYTES + 700
    assert answer.text == "".join(pieces)
