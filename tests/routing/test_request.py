"""Parsing a request for routing never fails on shapes the replica would judge instead."""

from __future__ import annotations

import orjson

from balancer.routing.request import canonical_prompt, parse_request


def nested(depth: int) -> list:
    root: list = []
    cur = root
    for _ in range(depth):
        cur.append([])
        cur = cur[0]
    return root


def test_canonical_chat_prompt_is_stable_and_ordered() -> None:
    data = {"tools": [{"b": 1, "a": 2}], "messages": [{"role": "system", "content": "S"},
                                                      {"role": "user", "content": [{"type": "text", "text": "Q"}]}]}
    assert canonical_prompt("/v1/chat/completions", data) == '<|tools|>[{"a":2,"b":1}]\n<|system|>S\n<|user|>Q'


def test_an_image_is_part_of_the_prefix_as_the_engines_cache_it() -> None:
    def prompt(url: str, question: str = "What is in it?") -> str:
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]
        return canonical_prompt("/v1/chat/completions", {"messages": [{"role": "user", "content": content}]})

    cat, dog = prompt("data:image/png;base64,Y2F0"), prompt("data:image/png;base64,ZG9n")
    # Different images share nothing past the user's role marker; the same image is the same prefix.
    assert cat != dog and cat.startswith("<|user|><|image_url|>")
    assert cat.split("\n")[0] != dog.split("\n")[0]
    assert prompt("data:image/png;base64,Y2F0", "And its colour?").split("\n")[0] == cat.split("\n")[0]


def test_messages_of_the_wrong_type_give_an_empty_prompt() -> None:
    assert canonical_prompt("/v1/chat/completions", {"messages": 5}) == ""
    assert canonical_prompt("/v1/chat/completions", {"messages": {"role": "user"}}) == ""


def test_generate_token_ids_are_hashed_as_ids_only_when_valid() -> None:
    assert canonical_prompt("/generate", {"input_ids": [1, 2, 3]}) == [1, 2, 3]
    assert isinstance(canonical_prompt("/generate", {"input_ids": [-1, 2]}), str)
    assert isinstance(canonical_prompt("/generate", {"input_ids": [1 << 40]}), str)


def test_pathological_nesting_is_not_walked() -> None:
    body = b'{"model": "m", "prompt": ' + b"[" * 1000 + b"]" * 1000 + b', "stream": true}'
    features = parse_request("/v1/completions", body, None, with_prompt=True)
    assert features.stream and features.prompt == ""
    deep_tools = {"model": "m", "messages": [], "tools": nested(300)}
    assert canonical_prompt("/v1/chat/completions", deep_tools) == "<|tools|>"


def test_generate_routes_under_the_adapter_its_lora_path_names() -> None:
    def model_of(lora_path: object, model: str | None = None) -> str | None:
        body: dict = {"text": "hi", "lora_path": lora_path}
        if model is not None:
            body["model"] = model
        return parse_request("/generate", orjson.dumps(body), None).model

    assert model_of("sql") == "sql"
    assert model_of(["sql", "sql"]) == "sql"
    assert model_of("sql", model="base") == "base:sql"
    # The base model, and batches that mix adapters or an adapter and the base, route as the base.
    assert model_of(None) is None and model_of("") is None and model_of([]) is None
    assert model_of(["sql", "chat"]) is None and model_of(["sql", None]) is None
    assert model_of({"name": "sql"}) is None
    # SGLang's OpenAI routes take lora_path too, where a BASE:ADAPTER model wins.
    for model, expected in (("base", "base:sql"), ("base:chat", "base:chat")):
        body = orjson.dumps({"model": model, "prompt": "hi", "lora_path": "sql"})
        assert parse_request("/v1/completions", body, None).model == expected
