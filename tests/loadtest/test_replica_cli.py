"""`kvlb replica` as the kvlb command discovers it, and as a process."""

import argparse
import json
import urllib.request
from importlib.metadata import entry_points

import pytest

from loadtest.replica.cli import config_from_args, main, register
from loadtest.replica.launch import ReplicaProcess


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvlb")
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_entry_point_is_registered():
    (entry,) = [e for e in entry_points(group="kvlb.commands") if e.name == "replica"]
    assert entry.load() is register


def test_arguments_build_the_config():
    args = parse(
        ["replica", "--port", "0", "--profile", "qwen3-8b-h100", "--kv-capacity-tokens", "5000",
         "--block-size", "32", "--max-running", "8", "--max-batched-tokens", "2048",
         "--time-scale", "10", "--model", "m", "--fault-error-rate", "0.5"]
    )  # fmt: skip
    assert args.func is main
    config = config_from_args(args)
    assert (config.profile, config.kv_capacity_tokens, config.block_size) == (
        "qwen3-8b-h100",
        5000,
        32,
    )
    assert (config.max_running, config.max_batched_tokens, config.time_scale) == (8, 2048, 10.0)
    assert config.model_name == "m"
    assert config.faults.error_rate == 0.5
    assert config_from_args(parse(["replica", "--port", "1"])).model_name == "kvlb-sim-llama-3.1-8b"


def test_unknown_profile_is_refused():
    with pytest.raises(SystemExit):
        parse(["replica", "--port", "0", "--profile", "gpt-5-on-a-toaster"])


def test_bad_values_exit_with_status_2(capsys):
    assert main(parse(["replica", "--port", "0", "--time-scale", "0"])) == 2
    assert "time_scale" in capsys.readouterr().err


def test_module_runs_and_stops_cleanly():
    with ReplicaProcess(["--profile", "llama-3.1-70b-h100-tp8", "--time-scale", "50"]) as replica:
        with urllib.request.urlopen(replica.url + "/get_server_info", timeout=5) as response:
            info = json.load(response)
        assert info["profile"] == "llama-3.1-70b-h100-tp8"
        assert info["kv_capacity_tokens"] == 1_380_000
        assert info["time_scale"] == 50
        body = json.dumps({"prompt": "one two three", "max_tokens": 3}).encode()
        request = urllib.request.Request(
            replica.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            assert json.load(response)["usage"]["completion_tokens"] == 3
        assert replica.stop() == 0  # SIGTERM is a clean shutdown
