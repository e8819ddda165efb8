"""The Kubernetes serving group's inference-perf (what llm-d benchmarks with) against kvlb.

It needs Python 3.12, so it lives in `.venv-inference-perf` (`make test-clients` builds it
from pyenv's or the system's 3.12 where there is one). It reads one YAML file; `run` writes
it for a server of type `vllm` at kvlb's URL, with a local tokenizer, and returns the
summary it writes (`summary_lifecycle_metrics.json`). `HF_HUB_OFFLINE=1` keeps it from any
model hub.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import yaml

VENV = Path(".venv-inference-perf")


def inference_perf_bin(venv: Path = VENV) -> Path:
    return venv / "bin" / "inference-perf"


def run(url: str, model: str, tokenizer: Path, out_dir: Path, api: dict[str, Any], data: dict[str, Any],
        rate: float, duration_s: float, venv: Path = VENV, timeout_s: float = 300.0) -> dict[str, Any]:
    config = {
        "api": api, "data": data,
        "load": {"type": "constant", "stages": [{"rate": rate, "duration": duration_s}], "num_workers": 1},
        "server": {"type": "vllm", "model_name": model, "base_url": url, "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": str(tokenizer)},
        "storage": {"local_storage": {"path": str(out_dir / "results")}},
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "config.yml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}
    done = subprocess.run([str(inference_perf_bin(venv).absolute()), "-c", str(path)], env=env, cwd=out_dir,
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"inference-perf exited with {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return json.loads((out_dir / "results" / "summary_lifecycle_metrics.json").read_text())
