"""Precise mode's tokenization: a model directory's tokenizer and chat template, as vLLM uses them."""

import json

import orjson
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from balancer.app import Balancer
from balancer.config import KvEventsSettings, parse_settings
from balancer.routing.precise import PromptTokens, RemotePrompt
from balancer.routing.tokenizer import ModelTokenizer, TokenizerError, tokenize_request_body

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("model")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<s>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50, trainer=trainer)
    # Like Llama's: plain text gets a BOS when special tokens are added.
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tokenizer.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "<|end|>"}, "chat_template": TEMPLATE}
    ))
    return root


def plain(model_dir) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def test_chat_is_rendered_by_the_template_and_tokenized_without_added_specials(model_dir):
    tokenizer = ModelTokenizer(model_dir)
    data = {"model": "m", "messages": [{"role": "system", "content": "the fox"}, {"role": "user", "content": "a dog"}]}
    text = "<s><|system|>\nthe fox<|end|>\n<|user|>\na dog<|end|>\n<|assistant|>\n"
    assert tokenizer.render_chat(data) == text
    assert tokenizer.prompt_ids("/v1/chat/completions", data) == plain(model_dir).encode(text, add_special_tokens=False).ids
    # Text parts are joined by newlines, as vLLM flattens them for a string template.
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert "<|user|>\na\nb<|end|>" in tokenizer.render_chat(parts)


def test_completion_text_gets_special_tokens_and_token_ids_pass_as_they_are(model_dir):
    tokenizer = ModelTokenizer(model_dir)
    ids = tokenizer.prompt_ids("/v1/completions", {"prompt": "the lazy dog"})
    assert ids[0] == 0 and ids == plain(model_dir).encode("the lazy dog").ids
    assert tokenizer.prompt_ids("/v1/completions", {"prompt": ["the lazy dog"]}) == ids  # a batch of one
    assert tokenizer.prompt_ids("/v1/completions", {"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert tokenizer.prompt_ids("/generate", {"input_ids": [9, 8]}) == [9, 8]
    assert tokenizer.prompt_ids("/generate", {"text": "the dog"}) == plain(model_dir).encode("the dog").ids
    assert tokenizer.prompt_ids("/v1/embeddings", {"input": "fox"}) == plain(model_dir).encode("fox").ids


@pytest.mark.parametrize("route,data", [
    ("/v1/chat/completions", {"messages": "not a list"}),
    ("/v1/chat/completions", {"messages": [7]}),
    ("/v1/completions", {"prompt": ["two", "prompts"]}),
    ("/v1/completions", {"prompt": [1, True]}),
    ("/v1/completions", {}),
])  # fmt: skip
def test_no_single_prompt_means_no_prediction_not_an_error(model_dir, route, data):
    assert ModelTokenizer(model_dir).prompt_ids(route, data) is None


def test_a_template_that_raises_gives_no_prediction(tmp_path, model_dir):
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('system role not supported') }}")
    tokenizer = ModelTokenizer(tmp_path)
    assert tokenizer.prompt_ids("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}) is None


def test_a_directory_without_a_tokenizer_is_a_start_up_error(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        ModelTokenizer(tmp_path)
    settings = parse_settings({
        "replicas": [{"url": "http://127.0.0.1:1"}], "policy": {"name": "cache_aware"},
        "kv_events": {"enabled": True, "tokenizer": str(tmp_path)},
    })
    with pytest.raises(Exception, match="kv_events: .*no tokenizer.json"):
        Balancer(settings)


def test_without_a_tokenizer_the_engines_tokenize_endpoint_is_asked(model_dir):
    by_model = PromptTokens(KvEventsSettings(enabled=True, tokenizers={"m": str(model_dir)}))
    assert isinstance(by_model.prompt_of("/v1/completions", {"model": "m", "prompt": "fox"}), list)
    remote = by_model.prompt_of("/v1/chat/completions", {"model": "other", "messages": [{"role": "user", "content": "x"}]})
    assert isinstance(remote, RemotePrompt)
    assert orjson.loads(bytes(remote)) == {"model": "other", "messages": [{"role": "user", "content": "x"}], "add_generation_prompt": True}
    # Token ids need no tokenizer at all.
    assert by_model.prompt_of("/generate", {"input_ids": [1, 2]}) == [1, 2]


def test_tokenize_bodies_follow_vllms_endpoint():
    assert orjson.loads(tokenize_request_body("/v1/completions", {"model": "m", "prompt": "hi"})) == {"model": "m", "prompt": "hi"}
    assert orjson.loads(tokenize_request_body("/generate", {"text": "hi"})) == {"prompt": "hi"}
    assert tokenize_request_body("/v1/completions", {"prompt": 5}) is None
    assert tokenize_request_body("/v1/chat/completions", {"messages": None}) is None
