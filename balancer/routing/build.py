"""A routing core built from settings, as `kvlb serve` builds it: the fleet with its breakers,
the policy, the cache tracker the policy needs (approximate, or precise with `kv_events`),
and the admission line."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from balancer.config import HealthSettings, ModelSettings, Settings
from balancer.routing.admission import AdmissionQueue
from balancer.routing.breaker import BreakerSettings
from balancer.routing.core import CallAt, CoreSettings, RoutingCore
from balancer.routing.fleet import Fleet
from balancer.routing.flow import UNBOUNDED, FlowClass, FlowController, TenantPolicy
from balancer.routing.precise import PreciseTracker
from balancer.routing.tracker import CacheTracker
from policies.base import Policy
from policies.registry import make_policy


def breaker_settings(health: HealthSettings) -> BreakerSettings:
    return BreakerSettings(
        health.eject_after_failures, health.ejection_base_s, health.ejection_max_s,
        health.success_rate_window_s, health.success_rate_min_requests,
        health.success_rate_min_clients, health.success_rate_threshold,
    )


def loop_call_at(when: float, callback: Callable[[float], None]) -> None:
    """Timers on the running event loop's clock; without a running loop, none are kept (a
    core used only to rank has nothing to forget)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    loop.call_at(when, lambda: callback(loop.time()))


def build_core(
    settings: Settings,
    policy: Policy | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
    call_at: CallAt = loop_call_at,
) -> RoutingCore:
    """`clock` dates the prefix index's entries (their TTL and LRU order); `call_at` runs the
    core's timers. Both default to the event loop's monotonic time, as in `kvlb serve`."""
    fleet = Fleet(settings.replicas, breaker_settings(settings.health))
    policy = policy or make_policy(settings.policy.name, settings.policy.params, settings.policy.seed)
    model_policies, model_limits = per_model_routing(settings.per_model)
    # Prefix hashing and the index cost CPU on every request: only for policies that use them.
    needs_prompt = policy.needs_prompt or any(p.needs_prompt for p in model_policies.values())
    tracker: CacheTracker | None = None
    if needs_prompt and settings.kv_events.enabled:
        tracker = PreciseTracker(settings.routing, settings.kv_events, clock)
    elif needs_prompt:
        tracker = CacheTracker(settings.routing, clock)
    limits = settings.limits
    queue: AdmissionQueue[Any] = AdmissionQueue(limits.max_in_flight, limits.max_queued)
    routing = settings.routing
    core_settings = CoreSettings(settings.retries.max_attempts, routing.region, routing.forget_unhealthy_after_s)
    return RoutingCore(fleet, policy, tracker, queue, core_settings, call_at, flow_controller(settings, fleet),
                       model_policies, model_limits)


def per_model_routing(per_model: Sequence[ModelSettings]) -> tuple[dict[str, Policy], dict[str, int]]:
    """`per_model` as the core takes it: each model's own policy, and its own bound."""
    policies = {m.model: make_policy(m.policy.name, m.policy.params, m.policy.seed)
                for m in per_model if m.policy is not None}
    limits = {m.model: m.max_in_flight for m in per_model if m.max_in_flight is not None}
    return policies, limits


def flow_controller(settings: Settings, fleet: Fleet) -> FlowController | None:
    """`flow_control` as the core runs it; None when it is off."""
    flow, limits = settings.flow_control, settings.limits
    if not flow.enabled:
        return None
    classes = [FlowClass(c.name, None if c.ttft_slo_ms is None else c.ttft_slo_ms / 1000.0, c.sheddable,
                         c.reserved_share, c.max_queued) for c in flow.classes]
    tenants = {t.name: TenantPolicy(t.weight, t.max_queued if t.max_queued is not None else flow.max_queued_per_tenant,
                                    t.priority)
               for t in settings.auth.tenants}
    return FlowController(
        classes, flow.default_class, limits.max_in_flight, limits.max_queued, limits.queue_timeout_s,
        lambda model, now: fleet.free_slots(model, now, UNBOUNDED), tenants, flow.max_tenants,
        default_max_queued=flow.max_queued_per_tenant, fairness_window_s=flow.fairness_window_s,
        headroom_places=flow.headroom_places,
    )
