"""kvlb, a KV-cache-aware load balancer for LLM inference.

The public surface: build a balancer from settings and run it in your own program, or use
the routing core alone to rank replicas for a prompt (docs/embedding.md). Everything else
in the package is internal and may change.

Names are imported on first use, so `import balancer` stays cheap for tools that need only
one corner of it (the test bed's replica, the CLI).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "Balancer",
    "ClientError",
    "ConfigError",
    "CoreSettings",
    "Journey",
    "Replica",
    "RequestFeatures",
    "RoutingCore",
    "RunningBalancer",
    "Settings",
    "build_core",
    "load_settings",
    "parse_settings",
    "start_balancer",
]

_HOMES = {
    "Balancer": "balancer.app",
    "RunningBalancer": "balancer.app",
    "start_balancer": "balancer.app",
    "ClientError": "balancer.errors",
    "ConfigError": "balancer.config",
    "Settings": "balancer.config",
    "load_settings": "balancer.config",
    "parse_settings": "balancer.config",
    "CoreSettings": "balancer.routing.core",
    "Journey": "balancer.routing.core",
    "RoutingCore": "balancer.routing.core",
    "build_core": "balancer.routing.build",
    "Replica": "balancer.routing.fleet",
    "RequestFeatures": "policies.base",
}

if TYPE_CHECKING:
    from balancer.app import Balancer, RunningBalancer, start_balancer
    from balancer.config import ConfigError, Settings, load_settings, parse_settings
    from balancer.errors import ClientError
    from balancer.routing.build import build_core
    from balancer.routing.core import CoreSettings, Journey, RoutingCore
    from balancer.routing.fleet import Replica
    from policies.base import RequestFeatures


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'balancer' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
