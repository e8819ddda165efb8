"""Settings: defaults, the example file, and one exact message per kind of mistake."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from balancer.config import (
    ConfigError,
    HeaderSettings,
    HealthSettings,
    Limits,
    Listen,
    LoggingSettings,
    ModelDiscoverySettings,
    Retries,
    Settings,
    Timeouts,
    check_config_main,
    load_settings,
    parse_settings,
    settings_from_args,
)

EXAMPLE = Path(__file__).resolve().parents[1] / "config" / "balancer.yaml"


def one_replica(**sections: object) -> dict:
    return {"replicas": [{"url": "http://127.0.0.1:9001"}], **sections}


def problems_of(data: object) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_settings(data)
    assert str(info.value) == "\n".join(info.value.problems)
    return info.value.problems


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvlb.yaml"
    path.write_text(text)
    return path


# --- what a valid file becomes ------------------------------------------------------------------


def test_defaults_fill_in_every_section():
    s = parse_settings(one_replica())
    assert isinstance(s, Settings)
    assert s.listen == Listen(host="127.0.0.1", port=8000)
    assert s.timeouts == Timeouts(connect_s=5.0, first_byte_s=60.0, total_s=600.0, stream_idle_s=120.0)
    assert s.retries == Retries(max_attempts=3)
    assert s.limits == Limits(max_body_bytes=32 * 1024 * 1024, max_in_flight=1024, max_header_bytes=16384)
    assert s.health == HealthSettings(
        path="/health", interval_s=5.0, timeout_s=2.0, unhealthy_threshold=2, healthy_threshold=1
    )
    assert s.models == ModelDiscoverySettings(refresh_s=30.0, timeout_s=2.0)
    assert s.headers == HeaderSettings(expose_replica=True, request_id="x-request-id")
    assert s.logging == LoggingSettings(level="info", format="text", access_log=False)
    assert (s.policy.name, dict(s.policy.params), s.policy.seed) == ("predictive", {}, None)
    (r,) = s.replicas
    assert (r.url, r.name, r.model, dict(r.labels)) == ("http://127.0.0.1:9001", "127.0.0.1:9001", None, {})
    assert (r.weight, r.max_concurrency, r.kv_capacity_tokens) == (1.0, None, None)


def test_empty_sections_mean_defaults():
    s = parse_settings(one_replica(health=None, limits={}))
    assert s.health == HealthSettings() and s.limits == Limits()


def test_example_file_loads_with_every_section_written_out():
    s = load_settings(EXAMPLE)
    assert [r.url for r in s.replicas] == [f"http://127.0.0.1:{p}" for p in (9001, 9002, 9003)]
    assert all(set(r.labels) == {"region", "zone", "tier"} for r in s.replicas)
    assert len({r.name for r in s.replicas}) == 3
    written = EXAMPLE.read_text()
    for f in dataclasses.fields(Settings):
        assert f"\n{f.name}:" in written, f"example lacks section {f.name}"
        section = getattr(s, f.name)
        if dataclasses.is_dataclass(section):
            for sub in dataclasses.fields(section):
                assert f" {sub.name}:" in written, f"example lacks {f.name}.{sub.name}"


@pytest.mark.parametrize(
    ("url", "stored", "name"),
    [
        ("http://127.0.0.1:9001", "http://127.0.0.1:9001", "127.0.0.1:9001"),
        ("http://gpu-a.internal/", "http://gpu-a.internal", "gpu-a.internal:80"),
        ("https://gpu-b.internal", "https://gpu-b.internal", "gpu-b.internal:443"),
        ("http://GPU-C:9000/prefix/", "http://GPU-C:9000/prefix", "gpu-c:9000"),
        ("http://[::1]:9000", "http://[::1]:9000", "[::1]:9000"),
    ],
)
def test_replica_name_defaults_to_host_and_port(url, stored, name):
    (r,) = parse_settings({"replicas": [{"url": url}]}).replicas
    assert (r.url, r.name) == (stored, name)


def test_explicit_name_wins_and_values_are_normalized():
    s = parse_settings(
        {
            "replicas": [
                {"url": "http://h:1", "name": "gpu-a", "labels": {"zone": 3, "rack": 1.5}, "weight": 2}
            ],
            "timeouts": {"connect_s": 3},
            "logging": {"level": "DEBUG", "format": "JSON"},
            "headers": {"request_id": "X-Trace-Id"},
            "policy": {"name": "random", "seed": 7},
        }
    )
    r = s.replicas[0]
    assert r.name == "gpu-a"
    assert dict(r.labels) == {"zone": "3", "rack": "1.5"}
    assert r.weight == 2.0 and isinstance(r.weight, float)
    assert s.timeouts.connect_s == 3.0 and isinstance(s.timeouts.connect_s, float)
    assert (s.logging.level, s.logging.format) == ("debug", "json")
    assert s.headers.request_id == "x-trace-id"
    assert (s.policy.name, s.policy.seed) == ("random", 7)


def test_settings_are_frozen_all_the_way_down():
    s = parse_settings(
        one_replica(policy={"name": "consistent_hash", "params": {"load_factor": 1.5}})
        | {"replicas": [{"url": "http://h:1", "labels": {"region": "eu"}}]}
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.listen = Listen()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.listen.port = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.replicas[0].name = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        s.replicas[0].labels["region"] = "us"  # type: ignore[index]
    with pytest.raises(TypeError):
        s.policy.params["load_factor"] = 2.0  # type: ignore[index]
    assert isinstance(s.replicas, tuple)


# --- one exact message per kind of mistake ------------------------------------------------------

REPLICAS = [{"url": f"http://127.0.0.1:{9001 + i}"} for i in range(3)]


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (
            {"replicas": [*REPLICAS[:2], {"url": "ftp://x"}]},
            "replicas[2].url: not an http(s) URL: 'ftp://x'",
        ),
        ({"replicas": [{"url": "127.0.0.1:9001"}]}, "replicas[0].url: not an http(s) URL: '127.0.0.1:9001'"),
        ({"replicas": [{"url": "http://h:99999"}]}, "replicas[0].url: not an http(s) URL: 'http://h:99999'"),
        ({"replicas": [{"url": "http://h/?q=1"}]}, "replicas[0].url: not an http(s) URL: 'http://h/?q=1'"),
        ({"replicas": [{"name": "gpu-a"}]}, "replicas[0].url: required key is missing"),
        (one_replica(timeouts={"connect_s": "abc"}), "timeouts.connect_s: expected a number, got 'abc'"),
        (one_replica(limits={"max_in_flight": True}), "limits.max_in_flight: expected an integer, got True"),
        (one_replica(retries={"max_attempts": 2.5}), "retries.max_attempts: expected an integer, got 2.5"),
        (one_replica(headers={"expose_replica": "yes"}), "headers.expose_replica: expected true or false, got 'yes'"),
        (one_replica(health=5), "health: expected a mapping, got 5"),
        ({"replicas": {"url": "http://h"}}, "replicas: expected a list, got a mapping"),
        (
            {"replicas": [{"url": "http://h", "labels": {"tier": ["a"]}}]},
            "replicas[0].labels.tier: expected a string, got a list",
        ),
        (one_replica(listn={"port": 1}), "listn: unknown key (did you mean 'listen'?)"),
        (one_replica(limits={"max_bdy_bytes": 1}), "limits.max_bdy_bytes: unknown key (did you mean 'max_body_bytes'?)"),
        ({"replicas": [{"url": "http://h", "zzz": 1}]}, "replicas[0].zzz: unknown key"),
        (
            {"replicas": [{"url": "http://a", "name": "x"}, {"url": "http://b", "name": "x"}]},
            "replicas[1].name: duplicate replica name 'x' (as replicas[0])",
        ),
        (
            {"replicas": [{"url": "http://h:9001"}, {"url": "http://h:9001/v1"}]},
            "replicas[1].name: duplicate replica name 'h:9001' (as replicas[0])",
        ),
        ({}, "replicas: at least one replica is required"),
        ({"replicas": []}, "replicas: at least one replica is required"),
        ({"replicas": None}, "replicas: at least one replica is required"),
        (one_replica(listen={"port": 0}), "listen.port: must be between 1 and 65535, got 0"),
        (one_replica(replicas=[{"url": "http://h", "weight": 0}]), "replicas[0].weight: must be > 0, got 0.0"),
        (one_replica(limits={"max_header_bytes": 100}), "limits.max_header_bytes: must be >= 1024, got 100"),
        (one_replica(timeouts={"first_byte_s": 700}), "timeouts.first_byte_s: must be <= total_s (600.0)"),
        (one_replica(health={"path": "health"}), "health.path: must start with '/', got 'health'"),
        (one_replica(logging={"level": "loud"}), "logging.level: must be one of debug, info, warning, error; got 'loud'"),
    ],
)
def test_each_mistake_is_named_by_its_key_path(data, problem):
    assert problems_of(data) == [problem]


def test_unknown_policy_lists_the_known_ones():
    (problem,) = problems_of(one_replica(policy={"name": "foo"}))
    assert problem.startswith("policy.name: unknown policy 'foo'; known: ")
    known = problem.split("known: ")[1].split(", ")
    for name in ("random", "round_robin", "least_load", "power_of_two", "consistent_hash"):
        assert name in known


def test_bad_policy_params_surface_as_config_errors():
    (problem,) = problems_of(one_replica(policy={"name": "consistent_hash", "params": {"load_factor": 0.5}}))
    assert problem.startswith("policy.params: ") and "load_factor" in problem
    (problem,) = problems_of(one_replica(policy={"name": "least_load", "params": {"nope": 1}}))
    assert problem.startswith("policy.params: ") and "nope" in problem


def test_every_problem_is_reported_at_once():
    problems = problems_of(
        {
            "replicas": [{"url": "ftp://x"}, {"url": "http://h", "weight": "heavy"}],
            "timeouts": {"connect_s": "abc", "total_s": -1},
            "limits": {"max_bdy_bytes": 1},
            "policy": {"name": "foo"},
            "extra": True,
        }
    )
    assert sorted(p.split(":")[0] for p in problems) == [
        "extra",
        "limits.max_bdy_bytes",
        "policy.name",
        "replicas[0].url",
        "replicas[1].weight",
        "timeouts.connect_s",
        "timeouts.total_s",
    ]


def test_top_level_must_be_a_mapping():
    assert problems_of([1, 2]) == ["top level: expected a mapping, got a list"]


# --- files, arguments and the check-config command ----------------------------------------------


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    assert info.value.problems == [f"{path}: no such file"]


def test_yaml_syntax_error_gives_line_and_column(tmp_path):
    path = write(tmp_path, "replicas:\n  - url: http://h\nlisten:\n  port: [8000\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    (problem,) = info.value.problems
    assert problem.startswith(f"{path}: line 5, column 1: invalid YAML: ")


def test_duplicate_yaml_key_is_an_error_not_a_silent_override(tmp_path):
    path = write(tmp_path, "replicas:\n  - url: http://h\nlisten:\n  port: 1\n  port: 2\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    assert info.value.problems == [f"{path}: line 5, column 3: invalid YAML: duplicate key 'port'"]


def test_yaml_merge_keys_still_override(tmp_path):
    text = "base: &b {weight: 2}\n"  # an unknown top-level key, reported below
    text += "replicas:\n  - {<<: *b, url: 'http://h:1', weight: 3}\n"
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, text))
    assert [p.split(": ", 1)[1] for p in info.value.problems] == ["base: unknown key"]


def test_file_problems_are_prefixed_by_the_path(tmp_path):
    path = write(tmp_path, "- just\n- a list\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    assert info.value.problems == [f"{path}: top level: expected a mapping, got a list"]
    path = write(tmp_path, "")
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    assert info.value.problems == [f"{path}: replicas: at least one replica is required"]


def test_settings_from_args_goes_through_validation():
    s = settings_from_args(["http://127.0.0.1:9001/", "http://127.0.0.1:9002"], "round_robin", "0.0.0.0", 9000)
    assert [r.name for r in s.replicas] == ["127.0.0.1:9001", "127.0.0.1:9002"]
    assert (s.policy.name, s.listen.host, s.listen.port) == ("round_robin", "0.0.0.0", 9000)
    with pytest.raises(ConfigError) as info:
        settings_from_args(["localhost:9001"], "nope")
    assert [p.split(":")[0] for p in info.value.problems] == ["replicas[0].url", "policy.name"]
    with pytest.raises(ConfigError, match="at least one replica"):
        settings_from_args([])


def test_check_config_main_reports_ok(capsys):
    assert check_config_main(EXAMPLE) == 0
    assert capsys.readouterr().out == "ok: 3 replicas, policy predictive\n"


def test_check_config_main_prints_every_problem(tmp_path, capsys):
    path = write(tmp_path, "replicas:\n  - url: ftp://x\nlimits:\n  max_bdy_bytes: 1\n")
    assert check_config_main(path) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"{path}: replicas[0].url: not an http(s) URL: 'ftp://x'",
        f"{path}: limits.max_bdy_bytes: unknown key (did you mean 'max_body_bytes'?)",
    ]


REPO = Path(__file__).resolve().parents[1]


def run_kvlb(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "balancer", *args], cwd=REPO, capture_output=True, text=True, timeout=60
    )


def test_kvlb_check_config_end_to_end(tmp_path):
    ok = run_kvlb("check-config", str(EXAMPLE))
    assert (ok.returncode, ok.stdout) == (0, "ok: 3 replicas, policy predictive\n"), ok.stderr
    path = write(tmp_path, "replicas:\n  - url: ftp://x\npolicy:\n  name: foo\n")
    bad = run_kvlb("check-config", str(path))
    assert bad.returncode == 1, bad.stderr
    lines = bad.stdout.splitlines()
    assert lines[0] == f"{path}: replicas[0].url: not an http(s) URL: 'ftp://x'"
    assert lines[1].startswith(f"{path}: policy.name: unknown policy 'foo'; known: ")
    assert len(lines) == 2


def test_the_two_models_example_gives_the_70b_its_own_engine_model_and_bound():
    s = load_settings(EXAMPLE.parent / "two-models.yaml")
    (big,) = s.per_model
    assert big.model == "llama-3.1-70b" and big.max_in_flight == 256
    assert big.policy is not None and big.policy.params["prefill_ms_per_token"] == 0.0668
    assert {r.model for r in s.replicas} == {"llama-3.1-70b", "llama-3.1-8b"}


def test_a_model_whose_roles_make_no_pair_is_refused_with_sglangs_protocol():
    def fleet(*members: tuple[str, str | None], **sections: object) -> dict:
        replicas = [{"url": f"http://127.0.0.1:{9001 + i}", "role": role, "bootstrap_port": 8998,
                     **({"model": model} if model else {})} for i, (role, model) in enumerate(members)]
        return {"replicas": replicas, **sections}

    assert problems_of(fleet(("prefill", "a"), ("decode", "b"))) == [
        "replicas: model 'a': prefill replicas but no decode replica nor one of role both; "
        "with SGLang's protocol none of its requests could be served",
        "replicas: model 'b': decode replicas but no prefill replica nor one of role both; "
        "with SGLang's protocol none of its requests could be served",
    ]
    assert "the replicas without a model: prefill replicas" in problems_of(fleet(("prefill", None)))[0]
    # A pair, a replica that serves alone, or a replica without a model that may be either: served.
    parse_settings(fleet(("prefill", "a"), ("decode", "a")))
    parse_settings(fleet(("prefill", "a"), ("both", "a")))
    parse_settings(fleet(("prefill", "a"), ("decode", None)))
    # With vLLM's protocol every engine serves a request whole.
    parse_settings(fleet(("prefill", "a"), disaggregation={"protocol": "vllm"}))
