"""Build a tiny Llama model directory that vLLM can serve on a CPU, with nothing downloaded.

Random weights (2 layers, hidden size 128) make the answers nonsense, but everything routing
cares about is real: the engine's tokenizer, its prefix cache, its KV events, its timings.
The tokenizer is a byte-level BPE trained here on generated text, with a chat template, so
kvlb's precise mode can tokenize prompts exactly as the engine does.

This file runs under the engine's own Python (it needs torch, transformers and tokenizers),
so it imports nothing of kvlb's:

    python tiny_model.py OUT_DIR
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<|begin|>", "<|end|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]

# The same shape as kvlb's simulated replica's template: role marker, content, in order,
# then the assistant marker that asks for a reply. The tokens of a shared system prompt or
# of earlier turns are therefore a shared token prefix.
CHAT_TEMPLATE = (
    "{{ '<|begin|>' }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + '\\n' + message['content'] + '<|end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' + '\\n' }}{% endif %}"
)


def training_text(lines: int = 4000, seed: int = 7) -> list[str]:
    """Words of the kind the load generators send (plain words and word-number mixes)."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ra", "to", "ne", "su", "vi", "de", "po", "an", "el", "or"]
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "system",
             "user", "assistant", "prompt", "document", "tenant", "turn", "question", "answer"]
    words += ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(600)]
    out = []
    for _ in range(lines):
        parts = [rng.choice(words) if rng.random() < 0.85 else f"w{rng.randint(0, 99999)}"
                 for _ in range(rng.randint(5, 30))]
        out.append(" ".join(parts))
    return out


def build_tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(training_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|begin|>",
        eos_token="<|end|>",
        pad_token="<|pad|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def build_model(out_dir: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=8192,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: tiny_model.py OUT_DIR", file=sys.stderr)
        return 2
    out_dir = Path(argv[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out_dir)
    build_model(out_dir)
    (out_dir / "kvlb-tiny-model.json").write_text(json.dumps({"vocab_size": VOCAB_SIZE}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
