"""NVIDIA's aiperf against kvlb, with nothing fetched at run time.

aiperf lives in an environment of its own (`make test-clients` builds `.venv-aiperf`), since
it pins its own versions of much that kvlb uses. It counts tokens with a Hugging Face
tokenizer: `word_tokenizer` writes a word-level one whose vocabulary is aiperf's own prompt
corpus, so aiperf and the simulated replica (one token per word) count alike, and prompts
keep their words (an unknown word would come back as `[UNK]`). aiperf must find no model hub:
`HF_ENDPOINT` points at a closed port on 127.0.0.1 (its offline flags break local tokenizer
paths).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

VENV = Path(".venv-aiperf")
CORPUS = "lib/python3.11/site-packages/aiperf/dataset/generator/assets/shakespeare.txt"
NO_HUB = "http://127.0.0.1:9"


def aiperf_bin(venv: Path = VENV) -> Path:
    return venv / "bin" / "aiperf"


def word_tokenizer(out_dir: Path, corpus: Path) -> Path:
    """A WordLevel tokenizer over `corpus`'s words, split on whitespace; `[UNK]` stays an
    ordinary token so that decoding never drops a word."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab: dict[str, int] = {"[UNK]": 0}
    for word in corpus.read_text(encoding="utf-8", errors="replace").split():
        vocab.setdefault(word, len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # words joined by single spaces
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]", "model_max_length": 1 << 20}))
    return out_dir


def profile(url: str, model: str, tokenizer: Path, out_dir: Path, args: Sequence[str],
            venv: Path = VENV, timeout_s: float = 300.0) -> dict[str, Any]:
    """`aiperf profile` against `url`; returns its summary (profile_export_aiperf.json) with
    its per-request records (profile_export.jsonl) under "records". Raises on a failed run,
    with aiperf's output."""
    env = {**os.environ, "HF_ENDPOINT": NO_HUB}
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.pop(name, None)
    argv = [str(aiperf_bin(venv)), "profile", "--model", model, "--url", url, "--tokenizer", str(tokenizer),
            "--ui-type", "none", "--no-gpu-telemetry", "--output-artifact-dir", str(out_dir), *args]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"aiperf exited with {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    summary = json.loads((out_dir / "profile_export_aiperf.json").read_text())
    lines = (out_dir / "profile_export.jsonl").read_text().splitlines()
    summary["records"] = [json.loads(line) for line in lines if line.strip()]
    return summary


def metric(record: dict[str, Any], name: str) -> float | None:
    value = record.get("metrics", {}).get(name)
    return None if value is None else value["value"]
