"""The proxy runs without its test bed: what the default container image holds."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Runs `kvlb ARGS` in a Python where the test bed cannot be imported, as in the image.
WITHOUT_TESTBED = """
import importlib.abc, sys
class NoTestBed(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "loadtest" or name.startswith("loadtest."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, NoTestBed())
from balancer.process.cli import main
sys.exit(main(sys.argv[1:]))
"""


def kvlb_without_testbed(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", WITHOUT_TESTBED, *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


def test_kvlb_runs_without_the_test_bed_and_lacks_only_its_commands() -> None:
    done = kvlb_without_testbed("--help")
    assert done.returncode == 0, done.stderr
    commands = set(re.findall(r"^    (\S+)", done.stdout, flags=re.M))
    assert {"serve", "check-config", "launch"} <= commands
    assert not commands & {"simulate", "compare", "loadtest", "replica", "stub-replica"}
    with_testbed = subprocess.run([sys.executable, "-m", "balancer", "--help"], capture_output=True, text=True,
                                  timeout=60, cwd=ROOT)
    assert "simulate" in set(re.findall(r"^    (\S+)", with_testbed.stdout, flags=re.M))
    checked = kvlb_without_testbed("check-config", str(ROOT / "config" / "container.yaml"))
    assert checked.returncode == 0, checked.stderr


def test_the_default_image_is_the_proxy_alone() -> None:
    stages = re.split(r"^FROM ", (ROOT / "Dockerfile").read_text(), flags=re.M)[1:]
    names = [stage.split()[2] for stage in stages]
    assert names[-1] == "runtime", "docker build without --target builds the last stage"
    runtime = stages[-1]
    copied = re.findall(r"^COPY (\S+)", runtime, flags=re.M)
    assert copied and not any(path.startswith(("loadtest", "tests")) for path in copied)
    assert "COPY loadtest" in stages[names.index("testbed")]
