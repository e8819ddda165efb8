"""Hot reload: apply a new, already validated configuration without dropping requests.

What changes live: the replicas the file lists (added, removed, or replaced when their settings
changed; requests in flight finish on the replica they started on), the policy, timeouts
(the client connections' too), retries, admission, connection and buffer limits, health
checks, model discovery, headers and logging. What is
bound at start (the listen address, body and header size limits, routing and its index, DNS
replica sets, API keys, the admin API) keeps its old value and is reported as needing a
restart, so an operator is never surprised by a setting that silently did not take.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from balancer.config import ConfigError, Settings, load_settings
from policies.registry import make_policy

if TYPE_CHECKING:
    from balancer.app import Balancer

log = logging.getLogger("kvlb.reload")
LIVE_SECTIONS = ("replicas", "policy", "timeouts", "retries", "health", "models", "headers", "logging")
# Within `limits`, what admission control and the client-facing server read per request or
# connection; the size limits are bound at start.
LIVE_LIMITS = ("max_in_flight", "max_queued", "queue_timeout_s", "max_connections", "max_buffered_bytes")


def reload_file(balancer: Balancer, path: str) -> dict[str, Any]:
    """Validate `path`, then apply it. An invalid file changes nothing and raises ConfigError."""
    return apply_settings(balancer, load_settings(path))


def apply_settings(balancer: Balancer, new: Settings) -> dict[str, Any]:
    old = balancer.settings
    new_policy = make_policy(new.policy.name, new.policy.params, new.policy.seed)
    if new_policy.needs_prompt != balancer.policy.needs_prompt:
        raise ConfigError(["policy.name: switching to or from a cache-aware policy needs a restart"])
    fleet = balancer.fleet
    wanted = {r.name: r for r in new.replicas}
    # Only replicas the file itself lists: those from DNS or the admin API are not the file's.
    configured = {r.name for r in old.replicas}
    added, removed, replaced = [], [], []
    for replica in list(fleet.replicas):
        if replica.name not in configured:
            continue
        target = wanted.get(replica.name)
        if target == replica.settings:
            continue
        balancer.left(fleet.remove(replica.name))
        (replaced if target is not None else removed).append(replica.name)
    for name, settings in wanted.items():
        if name not in fleet.by_name:
            balancer.joined(fleet.add(settings))
            if name not in replaced:
                added.append(name)
    policy_changed = new.policy != old.policy
    if policy_changed:
        balancer.policy = new_policy
    restart_needed = [
        f.name for f in dataclasses.fields(Settings)
        if f.name not in LIVE_SECTIONS + ("limits",) and getattr(new, f.name) != getattr(old, f.name)
    ]
    live_limits = {name: getattr(new.limits, name) for name in LIVE_LIMITS}
    if dataclasses.replace(new.limits, **{n: getattr(old.limits, n) for n in LIVE_LIMITS}) != old.limits:
        restart_needed.append("limits (max_body_bytes, max_header_bytes)")
    applied = dataclasses.replace(
        new,
        **{name: getattr(old, name) for name in restart_needed if "(" not in name},
        limits=dataclasses.replace(old.limits, **live_limits),
    )
    balancer.apply_live(applied)
    result = {"added": added, "removed": removed, "replaced": replaced,
              "policy_changed": policy_changed, "restart_needed": restart_needed}
    log.info("configuration reloaded: %s", result)
    if restart_needed:
        log.warning("changed sections that take effect only after a restart: %s", ", ".join(restart_needed))
    return result
