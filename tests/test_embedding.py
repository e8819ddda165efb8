"""The embedding example in docs/ runs as documented, and `python -m balancer` is the CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import balancer

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "examples" / "embedding.py"


def test_the_embedding_example_ranks_then_serves() -> None:
    done = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    # The core ranks first the replica it last sent the prompt to.
    sent = lines[0].split("first sent to ")[1].split(";")[0]
    assert f"the same prompt now ranks ['{sent}'," in lines[0]
    # The second request went where the first left its prefix, and found it cached.
    first, second = lines[1], lines[2]
    replica = first.split(" from ")[1].split(",")[0]
    assert second.split(" from ")[1].startswith(replica)
    assert " 0 of " in first and " 0 of " not in second


def test_the_public_surface_resolves_every_name_it_lists() -> None:
    for name in balancer.__all__:
        assert getattr(balancer, name) is not None
    assert set(dir(balancer)) == set(balancer.__all__)


def test_python_dash_m_balancer_is_the_kvlb_command() -> None:
    done = subprocess.run([sys.executable, "-m", "balancer", "--help"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and "usage: kvlb" in done.stdout
