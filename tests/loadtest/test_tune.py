"""`kvlb tune`: a grid of a policy's parameters, simulated in parallel, ranked by an objective,
and the winner written as a configuration kvlb accepts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from balancer.config import parse_settings
from loadtest.compare.tune import Trial, frontier, grid, parse_param

WORKLOAD = "shared-prefix,groups=4,prompts_per_group=30,system_tokens=3000,question_tokens=100,output_tokens=40,rate=30"


def tune(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "balancer", "tune", *args], capture_output=True, text=True, timeout=120)


def test_tune_ranks_every_combination_and_writes_the_winner_as_a_configuration(tmp_path: Path) -> None:
    done = tune("--workload", WORKLOAD, "--replicas", "2", "--policy", "cache_aware", "--param", "queue_weight=0,1",
                "--param", "decode_tokens_per_seq=0,64", "--objective", "ttft_p99", "--jobs", "2",
                "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in (tmp_path / "tune.md").read_text().splitlines()
            if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
    assert len(rows) == 4
    assert {(r[1].strip(), r[2].strip()) for r in rows} == {("0", "0"), ("0", "64"), ("1", "0"), ("1", "64")}
    p99 = [float(r[7].replace(",", "")) for r in rows]
    assert p99 == sorted(p99)  # best first
    best = yaml.safe_load((tmp_path / "best.yaml").read_text())
    assert best["policy"]["name"] == "cache_aware"
    assert best["policy"]["params"] == {"queue_weight": int(rows[0][1]), "decode_tokens_per_seq": int(rows[0][2])}
    settings = parse_settings({**best, "replicas": [{"url": "http://127.0.0.1:9001"}]})
    assert settings.policy.params == best["policy"]["params"]


def test_a_bad_parameter_is_refused_before_any_run(tmp_path: Path) -> None:
    done = tune("--workload", WORKLOAD, "--param", "queue_weight=-1", "--out", str(tmp_path))
    assert done.returncode == 2 and "queue_weight" in done.stderr
    assert not (tmp_path / "tune.md").exists()
    done = tune("--workload", WORKLOAD, "--param", "no_such_knob=1", "--out", str(tmp_path))
    assert done.returncode == 2 and "no_such_knob" in done.stderr


def test_the_grid_and_the_frontier() -> None:
    assert parse_param("queue_weight=0.25, 1") == ("queue_weight", [0.25, 1])
    assert grid([("a", [1, 2]), ("b", ["x"])]) == [{"a": 1, "b": "x"}, {"a": 2, "b": "x"}]

    def trial(p99: float, e2e: float) -> Trial:
        return Trial({}, None, None, p99, e2e, None, 0.0, 0.0, 0)

    # The second is beaten on both; the others each win on one.
    assert frontier([trial(1, 5), trial(2, 6), trial(3, 1)]) == {0, 2}
