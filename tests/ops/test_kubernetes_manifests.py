"""The Kubernetes manifests in config/kubernetes/ fit together, and fit kvlb.

No cluster runs here: each manifest is parsed with PyYAML and checked for what `kubectl
apply` would accept but a running system would trip over: selectors that match nothing,
probes on the wrong port or path, a config that kvlb refuses at start, a grace period shorter
than kvlb's drain, a disruption budget that blocks every drain.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from balancer.config import Settings, load_settings, parse_settings

MANIFESTS = Path(__file__).resolve().parents[2] / "config" / "kubernetes"
CONFIG_PATH = "/etc/kvlb/balancer.yaml"
EXPECTED = {
    "configmap.yaml": ("v1", "ConfigMap"),
    "deployment.yaml": ("apps/v1", "Deployment"),
    "service.yaml": ("v1", "Service"),
    "pdb.yaml": ("policy/v1", "PodDisruptionBudget"),
}


def load(name: str) -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all((MANIFESTS / name).read_text()) if d is not None]
    assert len(docs) == 1, f"{name}: expected one document, found {len(docs)}"
    return docs[0]


@pytest.fixture(scope="module")
def manifests() -> dict[str, dict[str, Any]]:
    return {name: load(name) for name in EXPECTED}


@pytest.fixture(scope="module")
def deployment(manifests: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return manifests["deployment.yaml"]


@pytest.fixture(scope="module")
def container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


@pytest.fixture(scope="module")
def config_text(manifests: dict[str, dict[str, Any]], deployment: dict[str, Any],
                container: dict[str, Any]) -> str:
    """The file kvlb reads at CONFIG_PATH: followed from the container's mount to the
    volume, to the ConfigMap it names, to the key the volume projects to that file name."""
    directory, _, filename = CONFIG_PATH.rpartition("/")
    mounts = [m for m in container["volumeMounts"] if m["mountPath"] in (directory, CONFIG_PATH)]
    assert len(mounts) == 1, f"nothing mounted at {CONFIG_PATH}"
    mount = mounts[0]
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    source = volumes[mount["name"]]["configMap"]
    configmap = manifests["configmap.yaml"]
    assert source["name"] == configmap["metadata"]["name"]
    if mount["mountPath"] == CONFIG_PATH:  # a subPath mount of one key
        key = mount["subPath"]
    else:
        key = next((i["key"] for i in source.get("items", []) if i["path"] == filename), filename)
    assert key in configmap["data"], f"the ConfigMap has no key {key!r}"
    return configmap["data"][key]


@pytest.fixture(scope="module")
def settings(config_text: str) -> Settings:
    return parse_settings(yaml.safe_load(config_text))


def test_every_manifest_is_there_with_its_kind(manifests: dict[str, dict[str, Any]]) -> None:
    assert sorted(p.name for p in MANIFESTS.glob("*.yaml")) == sorted(EXPECTED)
    for name, (api_version, kind) in EXPECTED.items():
        doc = manifests[name]
        assert (doc["apiVersion"], doc["kind"]) == (api_version, kind), name
        assert doc["metadata"]["name"].startswith("kvlb"), name
        assert doc["metadata"]["labels"]["app.kubernetes.io/name"] == "kvlb", name
    namespaces = {doc["metadata"].get("namespace") for doc in manifests.values()}
    assert len(namespaces) == 1, f"manifests in different namespaces: {namespaces}"


def test_selectors_find_the_deployments_pods(manifests: dict[str, dict[str, Any]],
                                             deployment: dict[str, Any]) -> None:
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector and selector.items() <= pod_labels.items()
    assert set(deployment["spec"]["selector"]) == {"matchLabels"}

    service = manifests["service.yaml"]["spec"]["selector"]
    assert service and service.items() <= pod_labels.items()
    # The Service selects exactly the Deployment's pods, not a superset of other pods.
    assert service == selector

    pdb = manifests["pdb.yaml"]["spec"]
    assert pdb["selector"]["matchLabels"] == selector
    assert set(pdb["selector"]) == {"matchLabels"}


def test_the_embedded_config_passes_kvlb_check_config(config_text: str, tmp_path: Path) -> None:
    path = tmp_path / "balancer.yaml"
    path.write_text(config_text)
    result = subprocess.run([sys.executable, "-m", "balancer", "check-config", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok:"), result.stdout
    # The strict loader kvlb serves with (duplicate keys are errors) agrees.
    assert load_settings(path) == parse_settings(yaml.safe_load(config_text))


def test_container_runs_kvlb_on_the_mounted_config(container: dict[str, Any]) -> None:
    assert container["image"] == "kvlb:latest"
    argv = container.get("command", ["kvlb", "serve", "--config", CONFIG_PATH]) + container.get("args", [])
    assert argv[:2] == ["kvlb", "serve"], argv
    assert argv[argv.index("--config") + 1] == CONFIG_PATH
    # --host/--port/--policy are refused alongside --config: the file is the one source.
    assert not {"--host", "--port", "--policy", "--replica"} & set(argv)
    mounts = [m for m in container["volumeMounts"] if CONFIG_PATH.startswith(m["mountPath"])]
    assert all(m.get("readOnly") for m in mounts)


def _container_port(container: dict[str, Any], port: int | str) -> int:
    """A probe's or Service's port (a number or a port name) as the container port number."""
    ports = container["ports"]
    if isinstance(port, str):
        named = [p["containerPort"] for p in ports if p.get("name") == port]
        assert len(named) == 1, f"no container port named {port!r}"
        return named[0]
    assert port in [p["containerPort"] for p in ports], f"{port} is not a container port"
    return port


def test_probes_ask_kvlb_on_its_listen_port(container: dict[str, Any], settings: Settings) -> None:
    readiness = container["readinessProbe"]["httpGet"]
    liveness = container["livenessProbe"]["httpGet"]
    assert readiness["path"] == "/ready"  # 503 while draining or with no healthy replica
    assert liveness["path"] == "/health"  # a restart would not bring replicas back
    for probe in (readiness, liveness):
        assert _container_port(container, probe["port"]) == settings.listen.port
        assert probe.get("scheme", "HTTP") == "HTTP"
    # The kubelet probes the pod's IP, so kvlb must listen beyond loopback.
    assert settings.listen.host in ("0.0.0.0", "::")


def test_service_reaches_the_listen_port(manifests: dict[str, dict[str, Any]], container: dict[str, Any],
                                         settings: Settings) -> None:
    ports = manifests["service.yaml"]["spec"]["ports"]
    assert ports
    for port in ports:
        target = port.get("targetPort", port["port"])
        assert _container_port(container, target) == settings.listen.port


def test_grace_period_outlasts_the_drain(deployment: dict[str, Any], container: dict[str, Any],
                                         settings: Settings) -> None:
    spec = deployment["spec"]["template"]["spec"]
    grace = spec["terminationGracePeriodSeconds"]
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    sleep_s = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
    # The grace period runs from the preStop hook; kvlb gets SIGTERM after it, then drains.
    assert grace > sleep_s + settings.timeouts.drain_s, (grace, sleep_s, settings.timeouts.drain_s)


def test_runs_as_non_root_with_resources(deployment: dict[str, Any], container: dict[str, Any]) -> None:
    pod = deployment["spec"]["template"]["spec"].get("securityContext", {})
    own = container.get("securityContext", {})
    merged = {**pod, **own}
    assert merged.get("runAsNonRoot") is True
    assert merged.get("runAsUser", 10001) != 0
    assert own.get("allowPrivilegeEscalation") is False
    assert own.get("privileged", False) is False
    assert "ALL" in own.get("capabilities", {}).get("drop", [])
    resources = container["resources"]
    assert {"cpu", "memory"} <= set(resources["requests"])
    assert "memory" in resources["limits"]


def test_disruption_budget_leaves_drains_possible(manifests: dict[str, dict[str, Any]],
                                                  deployment: dict[str, Any]) -> None:
    pdb = manifests["pdb.yaml"]["spec"]
    replicas = deployment["spec"]["replicas"]
    assert ("minAvailable" in pdb) != ("maxUnavailable" in pdb)
    if "minAvailable" in pdb:
        assert isinstance(pdb["minAvailable"], int) and 1 <= pdb["minAvailable"] < replicas
    else:
        assert pdb["maxUnavailable"] >= 1
    # A rolling update never takes the last ready pod away either.
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
