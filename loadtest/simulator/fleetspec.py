"""A virtual fleet for the offline simulator: which replicas, of what kind, where.

Either N identical replicas (`--replicas N --profile P`) or a YAML file of groups:

    region: us-east                  # where the balancer and its clients are
    round_trip_ms: {eu-west: 80}     # from there to each other region; same region: 0
    groups:
      - count: 50                    # replicas in this group (required, >= 1)
        profile: llama-3.1-8b-h100   # timing profile (loadtest/replica/profiles.py); default: the top-level `profile`
        region: us-east              # labels, as a kvlb replica's `labels`
        zone: us-east-1a
        tier: committed              # committed | overflow (cache_aware fills committed first)
        kv_capacity_tokens: 440000   # default: the profile's calibrated capacity
        max_running: 256
        max_batched_tokens: 8192
        context_limit: 131072        # longest prompt plus output a replica accepts
        weight: 1.0                  # relative speed, as a kvlb replica's `weight`
        max_loras: 4                 # LoRA adapter slots (vLLM --max-loras); default 0: no adapters
        lora_load_ms: 500            # model ms to load an adapter into a slot; default 100
        role: prefill                # prefill | decode | both (default): disaggregated serving
        host: rack1-node3            # a label: a prefill/decode pair on one host transfers fastest
        model: llama-3.1-8b          # the model it serves (default sim-model); several models
                                     # share one endpoint, each request going to its model's
      - count: 80
        region: eu-west
        tier: overflow

A top-level `profile` sets the default for every group. Replicas are named
`<region>-<n>` when the group has a region, else `replica-<n>`, numbered from 0 per prefix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from loadtest.replica.profiles import DEFAULT_PROFILE, PROFILES, Profile

GROUP_KEYS = {
    "count", "profile", "region", "zone", "tier", "kv_capacity_tokens", "max_running",
    "max_batched_tokens", "context_limit", "weight", "max_concurrency", "max_loras", "lora_load_ms",
    "role", "host", "model",
}  # fmt: skip
ROLES = ("both", "prefill", "decode")
TOP_KEYS = {"region", "round_trip_ms", "groups", "profile"}


class FleetError(ValueError):
    """The fleet description is wrong; the message says where."""


@dataclass(frozen=True, slots=True)
class ReplicaPlan:
    name: str
    profile: Profile
    labels: Mapping[str, str] = field(default_factory=dict)
    kv_capacity_tokens: int | None = None
    max_running: int = 256
    max_batched_tokens: int = 8192
    context_limit: int = 131072
    weight: float = 1.0
    round_trip_s: float = 0.0  # between the balancer and this replica
    max_concurrency: int | None = None  # the balancer's cap on requests at once (its config's)
    # LoRA adapter slots (0: it serves no adapter) and what loading one costs, in model ms.
    # It serves every adapter the workload names, as an engine started with them all.
    max_loras: int = 0
    lora_load_ms: float = 100.0
    role: str = "both"  # which half of a disaggregated request it serves
    model: str | None = None  # the model it serves; None: the simulator's one model


@dataclass(frozen=True, slots=True)
class FleetPlan:
    replicas: tuple[ReplicaPlan, ...]
    region: str | None = None
    description: str = ""

    @property
    def names(self) -> list[str]:
        return [replica.name for replica in self.replicas]


def _profile(name: Any, where: str) -> Profile:
    if name not in PROFILES:
        raise FleetError(f"{where}: unknown profile {name!r}; known: {', '.join(sorted(PROFILES))}")
    return PROFILES[name]


def _int(value: Any, where: str, low: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise FleetError(f"{where}: must be an integer >= {low}, got {value!r}")
    return value


def _load_ms(value: Any, where: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not value >= 0:
        raise FleetError(f"{where}: must be a number >= 0, got {value!r}")
    return float(value)


def uniform_fleet(
    replicas: int,
    profile: str = DEFAULT_PROFILE,
    kv_capacity_tokens: int | None = None,
    context_limit: int = 131072,
    max_concurrency: int | None = None,
    max_loras: int = 0,
    lora_load_ms: float = 100.0,
) -> FleetPlan:
    _int(replicas, "--replicas")
    chosen = _profile(profile, "--profile")
    plans = tuple(
        ReplicaPlan(f"replica-{i}", chosen, {}, kv_capacity_tokens, context_limit=context_limit,
                    max_concurrency=max_concurrency, max_loras=max_loras, lora_load_ms=lora_load_ms)
        for i in range(replicas)
    )
    extra = f", {kv_capacity_tokens:,} KV tokens each" if kv_capacity_tokens else ""
    if max_concurrency is not None:
        extra += f", at most {max_concurrency} requests each"
    if context_limit != 131072:
        extra += f", context limit {context_limit:,}"
    if max_loras:
        extra += f", {max_loras} adapter slots each ({lora_load_ms:g} ms a load)"
    return FleetPlan(plans, None, f"{replicas} x {profile}{extra}")


def parse_fleet(data: Any, source: str = "fleet") -> FleetPlan:
    if not isinstance(data, dict):
        raise FleetError(f"{source}: expected a mapping with 'groups'")
    unknown = set(data) - TOP_KEYS
    if unknown:
        raise FleetError(f"{source}: unknown key(s) {', '.join(sorted(unknown))}")
    region = data.get("region")
    if region is not None and not isinstance(region, str):
        raise FleetError(f"{source}: region must be a string")
    default_profile = data.get("profile", DEFAULT_PROFILE)
    round_trip = data.get("round_trip_ms") or {}
    if not isinstance(round_trip, dict) or not all(
        isinstance(k, str) and isinstance(v, int | float) and v >= 0 for k, v in round_trip.items()
    ):
        raise FleetError(f"{source}: round_trip_ms maps region names to milliseconds >= 0")
    groups = data.get("groups")
    if not isinstance(groups, list) or not groups:
        raise FleetError(f"{source}: 'groups' must be a non-empty list")
    plans: list[ReplicaPlan] = []
    numbering: dict[str, int] = {}
    parts: list[str] = []
    for g, group in enumerate(groups):
        where = f"{source}: groups[{g}]"
        if not isinstance(group, dict):
            raise FleetError(f"{where}: expected a mapping")
        unknown = set(group) - GROUP_KEYS
        if unknown:
            raise FleetError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
        count = _int(group.get("count"), f"{where}.count")
        profile = _profile(group.get("profile", default_profile), f"{where}.profile")
        labels = {}
        for key in ("region", "zone", "tier", "host"):
            value = group.get(key)
            if value is not None:
                if not isinstance(value, str) or not value:
                    raise FleetError(f"{where}.{key}: must be a non-empty string")
                labels[key] = value
        capacity = group.get("kv_capacity_tokens")
        if capacity is not None:
            capacity = _int(capacity, f"{where}.kv_capacity_tokens", 16)
        weight = group.get("weight", 1.0)
        if not isinstance(weight, int | float) or isinstance(weight, bool) or weight <= 0:
            raise FleetError(f"{where}.weight: must be a number > 0")
        model = group.get("model")
        if model is not None and (not isinstance(model, str) or not model):
            raise FleetError(f"{where}.model: must be a non-empty string")
        role = group.get("role", "both")
        if role not in ROLES:
            raise FleetError(f"{where}.role: must be one of {', '.join(ROLES)}, got {role!r}")
        replica_region = labels.get("region")
        rtt_ms = 0.0 if replica_region in (None, region) else float(round_trip.get(replica_region, 0.0))
        prefix = replica_region or "replica"
        for _ in range(count):
            n = numbering.get(prefix, 0)
            numbering[prefix] = n + 1
            plans.append(ReplicaPlan(
                name=f"{prefix}-{n}",
                profile=profile,
                labels=dict(labels),
                kv_capacity_tokens=capacity,
                max_running=_int(group.get("max_running", 256), f"{where}.max_running"),
                max_batched_tokens=_int(group.get("max_batched_tokens", 8192), f"{where}.max_batched_tokens"),
                context_limit=_int(group.get("context_limit", 131072), f"{where}.context_limit"),
                weight=float(weight),
                round_trip_s=rtt_ms / 1000.0,
                max_concurrency=None if group.get("max_concurrency") is None
                else _int(group["max_concurrency"], f"{where}.max_concurrency"),
                max_loras=_int(group.get("max_loras", 0), f"{where}.max_loras", 0),
                lora_load_ms=_load_ms(group.get("lora_load_ms", 100.0), f"{where}.lora_load_ms"),
                role=role,
                model=model,
            ))
        where_text = "/".join(labels[k] for k in ("region", "tier") if k in labels)
        parts.append(f"{count} x {profile.name}" + ("" if model is None else f" serving {model}")
                     + ("" if role == "both" else f" {role}") + (f" ({where_text}, +{rtt_ms:g} ms)" if rtt_ms else f" ({where_text})" if where_text else ""))
    return FleetPlan(tuple(plans), region, "; ".join(parts))


def load_fleet(path: str | Path) -> FleetPlan:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise FleetError(f"cannot read fleet file {path}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise FleetError(f"{path}: not valid YAML: {exc}") from None
    return parse_fleet(data, str(path))
