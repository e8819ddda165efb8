"""The YAML name of each policy, and the one way to build a policy from configuration."""

from __future__ import annotations

from collections.abc import Mapping
from importlib import import_module
from typing import Any

from policies.base import Policy

# One line per policy: "module:Class". The YAML name is the class's own `name`.
_POLICY_CLASSES = (
    "policies.random:RandomPolicy",
    "policies.round_robin:RoundRobinPolicy",
    "policies.least_load:LeastLoadPolicy",
    "policies.power_of_two:PowerOfTwoPolicy",
    "policies.consistent_hash:ConsistentHashPolicy",
    "policies.cache_aware:CacheAwarePolicy",
    "policies.predictive:PredictivePolicy",
    "policies.sglang_cache_aware:SGLangCacheAwarePolicy",
)


def _load(paths: tuple[str, ...]) -> dict[str, type[Policy]]:
    policies: dict[str, type[Policy]] = {}
    for path in paths:
        module, _, attr = path.partition(":")
        cls = getattr(import_module(module), attr)
        if not (isinstance(cls, type) and issubclass(cls, Policy) and cls.name):
            raise TypeError(f"{path} is not a Policy subclass with a name")
        if cls.name in policies:
            raise TypeError(f"policy name {cls.name!r} is used twice ({path})")
        policies[cls.name] = cls
    return policies


POLICIES: dict[str, type[Policy]] = _load(_POLICY_CLASSES)


def make_policy(
    name: str, params: Mapping[str, Any] | None = None, seed: int | None = None
) -> Policy:
    """Build the policy called `name` (its YAML name) with `params` (YAML `policy.params`).

    Raises ValueError for an unknown name or a bad parameter, naming what is wrong.
    """
    cls = POLICIES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}")
    params = dict(params or {})
    bad_keys = [key for key in params if not isinstance(key, str)]
    if bad_keys:
        raise ValueError(f"policy {name!r}: parameter names must be strings, got {bad_keys!r}")
    if "seed" in params:
        raise ValueError(f"policy {name!r}: 'seed' is not a policy parameter; pass seed= instead")
    return cls(seed=seed, **params)
