"""The names kvlb shares with its clients, replicas and test bed: one definition each.

Headers kvlb reads or writes on the wire, and the metric names that tools outside the
balancer (benchmarks, the load-test harness, dashboards) look for on `/metrics`. Anything
that speaks to kvlb imports the name from here rather than spelling it again.
"""

from __future__ import annotations

import importlib.metadata

# -- request headers -------------------------------------------------------------------------
# Affinity key for session-sticky routing; the body's `user` field is the fallback.
SESSION_HEADER = "x-session-id"
# Default names (configurable under `headers:` and `routing:`).
REQUEST_ID_HEADER = "x-request-id"
REGION_HEADER = "x-kvlb-region"
ALLOWED_REGIONS_HEADER = "x-kvlb-allowed-regions"
# Flow control, read only where `flow_control.trust_headers` (behind an authenticating
# gateway): who the request is for, its class, and its time-to-first-token target.
TENANT_HEADER = "x-kvlb-tenant"
PRIORITY_HEADER = "x-kvlb-priority"
TTFT_SLO_HEADER = "x-kvlb-ttft-slo-ms"

# -- answer headers --------------------------------------------------------------------------
# The replica that served the answer (`headers.expose_replica`).
REPLICA_HEADER = "x-kvlb-replica"
# The routing decision and its terms (`routing.route_header`).
ROUTE_HEADER = "x-kvlb-route"
# Why flow control refused a request (also the OpenAI error's `code`).
REJECT_REASON_HEADER = "x-kvlb-reject-reason"

# -- metric names the test bed reads ---------------------------------------------------------
METRIC_REQUESTS = "kvlb_requests"
METRIC_PREFIX_INDEX_ENTRIES = "kvlb_prefix_index_entries"
METRIC_PREFIX_INDEX_BYTES = "kvlb_prefix_index_bytes"
METRIC_PREFIX_INDEX_FAMILY = "kvlb_prefix_index_"
METRIC_SYNC_FAMILY = "kvlb_sync"
METRIC_SYNC_LAG = "kvlb_sync_lag_seconds"

# -- routes ------------------------------------------------------------------------------------
# What kvlb forwards to a replica; everything else it answers itself.
GENERATE_ROUTE = "/generate"  # SGLang's native route: its answers count tokens in `meta_info`
FORWARDED_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", GENERATE_ROUTE)
ADMIN_PREFIX = "/admin/"


def kvlb_version() -> str:
    """The installed package's version (`kvlb --version`, `GET /version`)."""
    try:
        return importlib.metadata.version("kvlb")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
