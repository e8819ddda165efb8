"""Balancer settings: YAML in, one frozen and validated `Settings` out.

Each key the balancer understands is a field of a dataclass below, with the same name and its
default. Validation is driven by those fields and their type hints, so a new setting is one new
field. Every problem is collected before failing, so a broken file is fixed in one pass rather
than one restart per mistake.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

import yaml

from balancer.protocol import ALLOWED_REGIONS_HEADER, REGION_HEADER, REQUEST_ID_HEADER
from policies.registry import POLICIES, make_policy


class ConfigError(Exception):
    """Every problem found in a configuration, one line each."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))

    def __str__(self) -> str:
        return "\n".join(self.problems)


# A check gets a well-typed value and returns the value to store (possibly normalized). It
# raises ValueError for a problem with the value itself, or ConfigError whose problems start
# with a relative key path (".name: ...", "[1].name: ...") for a problem deeper inside it.
Check = Callable[[Any], Any]


def _checked(default: Any = dataclasses.MISSING, check: Check | None = None, **meta: Any) -> Any:
    return field(default=default, metadata={"check": check, **meta})


def _section(cls: type, check: Check | None = None) -> Any:
    return field(default_factory=cls, metadata={"check": check})


def _rule(ok: Callable[[Any], bool], problem: str, normalize: Callable[[Any], Any] = lambda v: v) -> Check:
    """A check that stores `normalize(value)` when `ok` holds for it; `problem` gets {!r} of it."""

    def check(value: Any) -> Any:
        value = normalize(value)
        # `not ok(...)` rather than a negated comparison inside `ok`, so that NaN fails.
        if not ok(value):
            raise ValueError(problem.format(value))
        return value

    return check


def _at_least(low: int) -> Check:
    return _rule(lambda v: v >= low, f"must be >= {low}, got {{!r}}")


def _one_of(*choices: str) -> Check:
    return _rule(lambda v: v in choices, f"must be one of {', '.join(choices)}; got {{!r}}", str.lower)


_positive = _rule(lambda v: v > 0, "must be > 0, got {!r}")
_port = _rule(lambda v: 1 <= v <= 65535, "must be between 1 and 65535, got {!r}")
_non_empty = _rule(lambda v: v.strip() != "", "must not be empty, got {!r}")
_url_path = _rule(lambda v: v.startswith("/"), "must start with '/', got {!r}")
# A replica's name goes out in the x-kvlb-replica header, metric labels, log fields and admin
# paths: visible ASCII only, so it can never break an answer or forge a field.
_replica_name = _rule(
    re.compile(r"[\x21-\x7e]{1,200}").fullmatch,
    "must be 1 to 200 visible ASCII characters (no spaces), got {!r}",
)
# Member names are HOST/ADDRESS:PORT, so the host must be as safe as a name.
_host_name = _rule(
    re.compile(r"[A-Za-z0-9._:\[\]-]{1,200}").fullmatch, "not a host name: {!r}",
)


# HTTP header names are case-insensitive; storing one spelling keeps lookups simple.
_header_name = _rule(
    re.compile(r"[!#$%&'*+.^_`|~0-9a-z-]+").fullmatch, "not a valid HTTP header name: {!r}", str.lower
)


def _http_url(value: str) -> str:
    try:
        parts = urlsplit(value)
        port = parts.port  # raises ValueError for a malformed or out-of-range port
    except ValueError:
        parts = None
    if (
        parts is None
        or not value.isascii()
        or any(c.isspace() for c in value)
        or port == 0
        or parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.query
        or parts.fragment
    ):
        raise ValueError(f"not an http(s) URL: {value!r}")
    return value.rstrip("/")  # the proxy appends request paths that start with '/'


_zmq_endpoint = _rule(
    re.compile(r"(tcp://[^\s/]+:\d{1,5}|ipc://\S+)").fullmatch,
    "not a ZMQ endpoint (tcp://HOST:PORT or ipc://PATH): {!r}",
)


def _name_from_url(url: str) -> str:
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


@dataclass(frozen=True, slots=True)
class Listen:
    host: str = _checked("127.0.0.1", _non_empty)
    port: int = _checked(8000, _port)
    # Every chunk of an answer leaves at once. false lets the kernel coalesce small writes
    # (Nagle, as SGLang's router leaves it): less CPU per streamed token, but with clients
    # that delay their ACKs a token can wait ~40 ms.
    tcp_nodelay: bool = True


@dataclass(frozen=True, slots=True)
class ReplicaSettings:
    url: str = _checked(check=_http_url)
    name: str | None = _checked(None, _replica_name)  # filled from the url when not given
    model: str | None = _checked(None, _non_empty)  # None: discovered from /v1/models
    labels: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    weight: float = _checked(1.0, _positive)
    max_concurrency: int | None = _checked(None, _at_least(1))
    kv_capacity_tokens: int | None = _checked(None, _at_least(1))
    # The engine's KV event publisher (precise mode). Host `*` makes kvlb bind and the engine
    # connect, the engines' own rule the other way round.
    kv_events_endpoint: str | None = _checked(None, _zmq_endpoint)
    # LoRA adapters it serves besides those its /v1/models lists (a `parent` marks them
    # there), how many it holds in GPU slots at once (vLLM --max-loras, SGLang
    # --max-loras-per-batch; None: as the engine reports it, and 1, vLLM's default, until it
    # has) and what loading one into a slot costs.
    adapters: tuple[str, ...] = ()
    max_loras: int | None = _checked(None, _at_least(1))
    # How many adapters it keeps registered at once (SGLang --max-loaded-loras; None: as the
    # engine reports it, else no limit, as vLLM): kvlb unloads one before loading another past it.
    max_loaded_loras: int | None = _checked(None, _at_least(1))
    lora_load_ms: float = _checked(100.0, _rule(lambda v: v >= 0, "must be >= 0, got {!r}"))
    # Prefill/decode disaggregation (docs/disaggregation.md): which half of a request it
    # serves, and, for a prefill server speaking SGLang's protocol, the port of its
    # bootstrap server (SGLang's --disaggregation-bootstrap-port) that decode servers reach.
    role: str = _checked("both", _one_of("both", "prefill", "decode"))
    bootstrap_port: int | None = _checked(None, _port)

    def __post_init__(self) -> None:
        if self.name is None:
            object.__setattr__(self, "name", _name_from_url(self.url))


@dataclass(frozen=True, slots=True)
class PolicySettings:
    name: str = "predictive"
    params: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    seed: int | None = None


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect_s: float = _checked(5.0, _positive)
    first_byte_s: float = _checked(60.0, _positive)
    total_s: float = _checked(600.0, _positive)
    stream_idle_s: float = _checked(120.0, _positive)
    # How long a write to a client may wait for the client to read. A client that stops
    # reading ends its own answer; it is never counted against the replica.
    client_write_s: float = _checked(30.0, _positive)
    # Reading a client's request: its head, then its body, each from its first byte; more
    # bytes do not extend them, so a client that drips cannot hold a connection (408).
    client_head_s: float = _checked(30.0, _positive)
    client_body_s: float = _checked(60.0, _positive)
    # An idle kept-alive client connection closes after this.
    client_idle_s: float = _checked(75.0, _positive)
    drain_s: float = _checked(30.0, _positive)  # on SIGTERM: how long requests in flight may finish


@dataclass(frozen=True, slots=True)
class Retries:
    max_attempts: int = _checked(3, _at_least(1))


@dataclass(frozen=True, slots=True)
class Limits:
    max_body_bytes: int = _checked(32 * 1024 * 1024, _at_least(1))
    max_in_flight: int = _checked(1024, _at_least(1))
    max_queued: int = _checked(1024, _at_least(0))  # requests waiting for capacity; beyond: 429
    queue_timeout_s: float = _checked(10.0, _positive)  # longest wait for capacity; then 429
    max_header_bytes: int = _checked(16384, _at_least(1024))
    # Open client connections; beyond: 503 with Retry-After, and the connection is closed.
    max_connections: int = _checked(4096, _at_least(1))
    # Request bodies buffered at once, all connections together (a body counts from its
    # head until its answer ends); beyond: 503 with Retry-After, before the body is read.
    max_buffered_bytes: int = _checked(512 * 1024 * 1024, _at_least(1))


@dataclass(frozen=True, slots=True)
class HealthSettings:
    path: str = _checked("/health", _url_path)
    interval_s: float = _checked(5.0, _positive)
    timeout_s: float = _checked(2.0, _positive)
    unhealthy_threshold: int = _checked(2, _at_least(1))
    healthy_threshold: int = _checked(1, _at_least(1))
    # Passive outlier ejection from live traffic (see balancer/routing/breaker.py).
    eject_after_failures: int = _checked(5, _at_least(1))
    ejection_base_s: float = _checked(5.0, _positive)
    ejection_max_s: float = _checked(300.0, _positive)
    # 500s say as much about the request as about the replica, so they eject only by success
    # rate over a window, with answers from several clients (see balancer/routing/breaker.py).
    success_rate_window_s: float = _checked(30.0, _positive)
    success_rate_min_requests: int = _checked(20, _at_least(1))
    success_rate_min_clients: int = _checked(3, _at_least(1))
    success_rate_threshold: float = _checked(0.5, _rule(lambda v: 0 < v <= 1, "must be in (0, 1], got {!r}"))


@dataclass(frozen=True, slots=True)
class ModelDiscoverySettings:
    refresh_s: float = _checked(30.0, _positive)
    timeout_s: float = _checked(2.0, _positive)


@dataclass(frozen=True, slots=True)
class HeaderSettings:
    expose_replica: bool = True
    request_id: str = _checked(REQUEST_ID_HEADER, _header_name)


@dataclass(frozen=True, slots=True)
class LoggingSettings:
    level: str = _checked("info", _one_of("debug", "info", "warning", "error"))
    format: str = _checked("text", _one_of("text", "json"))
    access_log: bool = False


@dataclass(frozen=True, slots=True)
class TracingSettings:
    """OpenTelemetry traces over OTLP/HTTP (needs kvlb[tracing]); off without an endpoint."""

    otlp_endpoint: str | None = _checked(None, _http_url)  # e.g. http://127.0.0.1:4318/v1/traces
    service_name: str = _checked("kvlb", _non_empty)
    sample_ratio: float = _checked(1.0, _rule(lambda v: 0 <= v <= 1, "must be in [0, 1], got {!r}"))
    export_interval_s: float = _checked(1.0, _positive)  # how long finished spans wait to be sent together


@dataclass(frozen=True, slots=True)
class RoutingSettings:
    """How requests are turned into prefixes and located: used by cache-aware policies."""

    region: str | None = _checked(None, _non_empty)  # this balancer's own region
    region_header: str = _checked(REGION_HEADER, _header_name)
    allowed_regions_header: str = _checked(ALLOWED_REGIONS_HEADER, _header_name)
    route_header: bool = False  # x-kvlb-route on answers: the decision and its terms
    block_chars: int = _checked(64, _at_least(1))
    tokens_per_char: float = _checked(0.25, _positive)  # the start; learned per model unless told not to
    learn_tokens_per_char: bool = True
    index_ttl_s: float = _checked(600.0, _positive)
    index_max_entries: int = _checked(2_000_000, _at_least(1))
    # An answer's first characters enter the index after its prompt, on the replica that
    # wrote it (a conversation's next turn sends it back); 0 keeps answers out.
    index_answer_chars: int = _checked(65_536, _at_least(0))
    # A replica's KV capacity when neither its config nor the engine says (vLLM does not):
    # the index never predicts more cached than this, so a stream of distinct prompts costs
    # a bounded share of memory per replica rather than the whole budget.
    assumed_kv_capacity_tokens: int = _checked(1 << 20, _at_least(1))
    forget_unhealthy_after_s: float = _checked(30.0, _positive)


# A tenant's or class's name goes into metric labels and the access log: visible ASCII.
# (The proxy holds a tenant named by a header to the same pattern.)
LABEL_NAME = re.compile(r"[\x21-\x7e]{1,100}")
_label_name = _rule(
    LABEL_NAME.fullmatch,
    "must be 1 to 100 visible ASCII characters (no spaces), got {!r}",
)
_share = _rule(lambda v: 0 <= v < 1, "must be in [0, 1), got {!r}")


@dataclass(frozen=True, slots=True)
class TenantSettings:
    """A tenant: its API keys, its class (`priority`) and its share when the fleet is saturated."""

    name: str = _checked(check=_label_name)
    api_keys: tuple[str, ...] = ()
    api_keys_env: str | None = _checked(None, _non_empty)  # variable holding comma-separated keys
    priority: str | None = _checked(None, _label_name)  # a flow_control class; default: default_class
    weight: float = _checked(1.0, _positive)  # its share of tokens against other tenants of its class
    max_queued: int | None = _checked(None, _at_least(0))  # its requests waiting at once


def _unique(key: str) -> Check:
    """A list's check: no two of its entries share `key`."""

    def check(items: tuple[Any, ...]) -> tuple[Any, ...]:
        seen: dict[str, int] = {}
        problems = []
        for i, item in enumerate(items):
            value = getattr(item, key)
            if value in seen:
                problems.append(f"[{i}].{key}: duplicate {key} {value!r} (as [{seen[value]}])")
            seen.setdefault(value, i)
        if problems:
            raise ConfigError(problems)
        return items

    return check


_uniquely_named = _unique("name")


@dataclass(frozen=True, slots=True)
class AuthSettings:
    """Client API keys. With none configured, kvlb is open (as a bare engine would be)."""

    api_keys: tuple[str, ...] = ()
    api_keys_file: str | None = _checked(None, _non_empty)  # one key a line; '#' comments
    api_keys_env: str | None = _checked(None, _non_empty)  # variable holding comma-separated keys
    replica_api_key_env: str | None = _checked(None, _non_empty)  # replaces the client's key toward replicas
    rate_limit_per_s: float | None = _checked(None, _positive)  # requests per second per key (token bucket)
    rate_limit_burst: int | None = _checked(None, _at_least(1))  # bucket size; default: one second's worth
    # Keys grouped by tenant, each with its flow-control class, weight and limits.
    tenants: tuple[TenantSettings, ...] = _checked((), check=_uniquely_named)


@dataclass(frozen=True, slots=True)
class AdminSettings:
    """The admin API under /admin/: off unless a token is configured."""

    token_env: str | None = _checked(None, _non_empty)  # variable holding the admin bearer token
    # Serve the admin API on its own address only (e.g. 127.0.0.1, away from clients).
    listen_host: str | None = _checked(None, _non_empty)
    listen_port: int | None = _checked(None, _port)


@dataclass(frozen=True, slots=True)
class KvEventsSettings:
    """Precise mode: the index follows the engines' own KV events (BlockStored, BlockRemoved)
    instead of predicting what they cache. Replicas name their publishers in
    `kv_events_endpoint`; prompts are tokenized as the engine tokenizes them."""

    enabled: bool = False
    block_size: int = _checked(16, _at_least(1))  # the engines' KV block size in tokens (vLLM on CPU: 128)
    # Model directory holding tokenizer.json and the chat template, for every model; None: ask
    # a replica's /tokenize (one more round trip per request).
    tokenizer: str | None = _checked(None, _non_empty)
    tokenizers: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))  # per model
    topic: str = ""  # subscribe to topics starting with this ("" is all)
    speculative_ttl_s: float = _checked(2.0, _positive)  # a routed prompt counts as cached until its events arrive
    tokenize_timeout_s: float = _checked(2.0, _positive)  # the /tokenize fallback's deadline
    max_blocks_per_replica: int = _checked(1_000_000, _at_least(1))  # engine hashes remembered per replica


_redis_url = _rule(
    lambda v: v.startswith(("redis://", "rediss://", "unix://")),
    "must start with redis://, rediss:// or unix://, got {!r}",
)


@dataclass(frozen=True, slots=True)
class SyncSettings:
    """Routing state shared with other kvlb instances through Redis; off unless redis_url is set."""

    redis_url: str | None = _checked(None, _redis_url)
    key_prefix: str = _checked("kvlb", _non_empty)  # keys and the stream of all instances that share state
    instance_id: str | None = _checked(None, _non_empty)  # default: host name, process id and a random suffix
    publish_interval_s: float = _checked(0.01, _positive)  # routing events leave in batches this often
    load_interval_s: float = _checked(0.1, _positive)  # per-replica load snapshot, and peers' read back
    load_ttl_s: float = _checked(1.0, _positive)  # a silent instance's snapshot (and membership) lapses after this
    stream_max_len: int = _checked(10_000, _at_least(1))  # batches of routing events Redis keeps per instance (approximately)
    max_pending_events: int = _checked(10_000, _at_least(1))  # events held while Redis is away; oldest dropped
    timeout_s: float = _checked(0.5, _positive)  # per Redis command


@dataclass(frozen=True, slots=True)
class ReplicaSetSettings:
    """Replicas found by resolving a host name (a Kubernetes headless service, say): each
    address it resolves to is a replica, joining and leaving as the answers change."""

    host: str = _checked(check=_host_name)
    port: int = _checked(check=_port)
    scheme: str = _checked("http", _one_of("http", "https"))
    model: str | None = _checked(None, _non_empty)
    labels: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    weight: float = _checked(1.0, _positive)
    max_concurrency: int | None = _checked(None, _at_least(1))
    kv_capacity_tokens: int | None = _checked(None, _at_least(1))
    kv_events_port: int | None = _checked(None, _port)  # each member's KV event publisher (precise mode)
    refresh_s: float = _checked(10.0, _positive)


def _some_replicas_uniquely_named(replicas: tuple[ReplicaSettings, ...]) -> tuple[ReplicaSettings, ...]:
    first_seen: dict[str, int] = {}
    problems = []
    for i, replica in enumerate(replicas):
        if replica.name in first_seen:
            j = first_seen[replica.name]
            problems.append(f"[{i}].name: duplicate replica name {replica.name!r} (as replicas[{j}])")
        first_seen.setdefault(replica.name, i)
    if problems:
        raise ConfigError(problems)
    return replicas


def _known_policy(policy: PolicySettings) -> PolicySettings:
    if policy.name not in POLICIES:
        known = ", ".join(sorted(POLICIES))
        raise ConfigError([f".name: unknown policy {policy.name!r}; known: {known}"])
    # Building the policy once here makes bad params a config error instead of a crash at startup.
    try:
        make_policy(policy.name, dict(policy.params), policy.seed)
    except (ValueError, TypeError) as e:
        raise ConfigError([f".params: {e}"]) from None
    return policy


@dataclass(frozen=True, slots=True)
class FlowClassSettings:
    name: str = _checked(check=_label_name)
    ttft_slo_ms: float | None = _checked(None, _positive)  # its time-to-first-token target
    sheddable: bool = False  # refused or pushed out first when the queue is full
    # Of the places that free while it waits, the share it gets even when higher classes
    # wait too: lower classes then never starve.
    reserved_share: float = _checked(0.0, _share)
    max_queued: int | None = _checked(None, _at_least(0))  # default: limits.max_queued


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """One model's own routing, where its fleet differs from the rest (a 70B beside an 8B)."""

    model: str = _checked(check=_non_empty)  # as requests name it in `model`
    policy: PolicySettings | None = _checked(None, _known_policy)  # default: the top-level policy
    max_in_flight: int | None = _checked(None, _at_least(1))  # its requests at once; beyond, 429


@dataclass(frozen=True, slots=True)
class LoadableAdapter:
    """A LoRA adapter kvlb may ask a replica to load when no replica serves it yet."""

    name: str = _checked(check=_non_empty)  # as requests name it in `model`
    path: str = _checked(check=_non_empty)  # where the engine finds it (its lora_path)
    base: str = _checked(check=_non_empty)  # the base model it applies to: replicas serving it may load it


@dataclass(frozen=True, slots=True)
class AdapterSettings:
    """LoRA adapters loaded on demand (docs/adapters.md). vLLM needs
    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True for its load endpoint; SGLang takes
    `load_path: /load_lora_adapter`."""

    load_on_demand: tuple[LoadableAdapter, ...] = _checked((), check=_uniquely_named)
    load_path: str = _checked("/v1/load_lora_adapter", _url_path)
    # None: the load path's sibling (/v1/unload_lora_adapter, SGLang's /unload_lora_adapter).
    unload_path: str | None = _checked(None, _url_path)
    load_timeout_s: float = _checked(30.0, _positive)
    # A replica that holds as many adapters as it may (`max_loaded_loras`) unloads the
    # coldest one kvlb can load again, with no request of kvlb's running on it, to make room.
    unload_to_make_room: bool = True


@dataclass(frozen=True, slots=True)
class DisaggregationSettings:
    """How a request is split between a prefill and a decode replica, when a model's fleet
    has both roles (balancer/routing/disaggregation.py, docs/disaggregation.md)."""

    # The engines' wire protocol: SGLang's bootstrap room sent to both at once, or vLLM's
    # kv_transfer_params handed from the prefill answer to the decode request.
    protocol: str = _checked("sglang", _one_of("sglang", "vllm"))
    # A prompt whose uncached part on the best prefill replica is shorter runs whole on one
    # replica that can (role both; with vLLM, any replica): its prefill costs less
    # than the transfer and the second hop.
    colocate_below_tokens: int = _checked(512, _at_least(0))
    # With a policy that predicts time: a request runs whole on a replica that can (as
    # above) when the prefill pool's predicted first token, transfer included, would come
    # this many times later: the prefill pool is saturated.
    saturated_ratio: float = _checked(2.0, _rule(lambda v: v >= 1, "must be >= 1, got {!r}"))
    # KV cache bytes per token of the model (llama-3.1-8b in bf16: 2 x 32 layers x 8 KV
    # heads x 128 x 2 bytes), and the link between a pair by how close it is (labels
    # `host`, then `zone`): what a transfer costs the decode replica's first token.
    kv_bytes_per_token: int = _checked(131072, _at_least(1))
    same_host_gbps: float = _checked(400.0, _positive)
    same_zone_gbps: float = _checked(100.0, _positive)
    other_gbps: float = _checked(25.0, _positive)


@dataclass(frozen=True, slots=True)
class FlowControlSettings:
    """Who waits, in which order, and who is refused once the fleet is saturated
    (balancer/routing/flow.py). Off: one first-come-first-served line (`limits`)."""

    enabled: bool = False
    # Behind an authenticating gateway: x-kvlb-tenant, x-kvlb-priority and
    # x-kvlb-ttft-slo-ms say who a request is for and how urgent it is.
    trust_headers: bool = False
    classes: tuple[FlowClassSettings, ...] = _checked(
        (FlowClassSettings(name="standard"),), check=_uniquely_named)  # highest priority first
    default_class: str = _checked("standard", _label_name)
    max_queued_per_tenant: int | None = _checked(None, _at_least(0))  # for tenants that set none
    # How long a tenant's service is remembered in the fair share (its time constant): a
    # tenant that used little for this long goes ahead of one that used much.
    fairness_window_s: float = _checked(10.0, _positive)
    # Places kept free for lighter tenants while the heaviest one of a class floods: they
    # then find one at once, for at most this many places of the heaviest one's throughput.
    headroom_places: int = _checked(1, _at_least(0))
    # Tenants named by headers get metric labels and fair-share state up to this many.
    max_tenants: int = _checked(1024, _at_least(1))


def _flow_classes_known(flow: FlowControlSettings) -> FlowControlSettings:
    if not flow.classes:
        raise ConfigError([".classes: at least one class is required"])
    if flow.default_class not in {c.name for c in flow.classes}:
        raise ConfigError([f".default_class: {flow.default_class!r} is not one of the classes"])
    return flow


def _first_byte_within_total(timeouts: Timeouts) -> Timeouts:
    if timeouts.first_byte_s > timeouts.total_s:
        raise ConfigError([f".first_byte_s: must be <= total_s ({timeouts.total_s!r})"])
    return timeouts


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    listen: Listen = _section(Listen)
    replicas: tuple[ReplicaSettings, ...] = _checked((), check=_some_replicas_uniquely_named)
    replica_sets: tuple[ReplicaSetSettings, ...] = ()
    policy: PolicySettings = _section(PolicySettings, _known_policy)
    timeouts: Timeouts = _section(Timeouts, _first_byte_within_total)
    retries: Retries = _section(Retries)
    limits: Limits = _section(Limits)
    health: HealthSettings = _section(HealthSettings)
    models: ModelDiscoverySettings = _section(ModelDiscoverySettings)
    headers: HeaderSettings = _section(HeaderSettings)
    routing: RoutingSettings = _section(RoutingSettings)
    auth: AuthSettings = _section(AuthSettings)
    admin: AdminSettings = _section(AdminSettings)
    logging: LoggingSettings = _section(LoggingSettings)
    tracing: TracingSettings = _section(TracingSettings)
    sync: SyncSettings = _section(SyncSettings)
    kv_events: KvEventsSettings = _section(KvEventsSettings)
    flow_control: FlowControlSettings = _section(FlowControlSettings, _flow_classes_known)
    adapters: AdapterSettings = _section(AdapterSettings)
    disaggregation: DisaggregationSettings = _section(DisaggregationSettings)
    per_model: tuple[ModelSettings, ...] = _checked((), check=_unique("model"))


# --- validation engine ------------------------------------------------------------------------

_INVALID: Any = object()
_SCALARS: dict[type, tuple[str, tuple[type, ...]]] = {
    bool: ("true or false", (bool,)),
    int: ("an integer", (int,)),
    float: ("a number", (int, float)),
    str: ("a string", (str,)),
}


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _wrong(expected: str, value: Any, where: str, problems: list[str]) -> Any:
    problems.append(f"{where}: expected {expected}, got {_describe(value)}")
    return _INVALID


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return MappingProxyType({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def _convert(tp: Any, value: Any, where: str, problems: list[str]) -> Any:
    """`value` as type `tp`, or _INVALID after appending why to `problems`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is types.UnionType:  # the schema only uses `X | None`
        if value is None:
            return None
        (tp,) = [a for a in args if a is not type(None)]
        return _convert(tp, value, where, problems)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where, problems)
    if origin is tuple:
        if not isinstance(value, list | type(None)):
            return _wrong("a list", value, where, problems)
        items = [_convert(args[0], v, f"{where}[{i}]", problems) for i, v in enumerate(value or [])]
        return _INVALID if _INVALID in items else tuple(items)
    if origin is Mapping:
        if not isinstance(value, dict | type(None)):
            return _wrong("a mapping", value, where, problems)
        out = {}
        for key, item in (value or {}).items():
            if not isinstance(key, str):
                problems.append(f"{where}: keys must be strings, got {key!r}")
                out[key] = _INVALID
                continue
            if args[1] is str and isinstance(item, int | float) and not isinstance(item, bool):
                item = str(item)  # `zone: 3` in YAML is a number; labels are text
            out[key] = _convert(args[1], item, f"{where}.{key}", problems)
        return _INVALID if _INVALID in out.values() else MappingProxyType(out)
    if tp is Any:
        return _freeze(value)
    expected, accepted = _SCALARS[tp]
    # bool is an int subclass in Python, but `true` where a number belongs is a mistake.
    if not isinstance(value, accepted) or (isinstance(value, bool) and tp is not bool):
        return _wrong(expected, value, where, problems)
    return float(value) if tp is float else value


def _build(cls: type, data: Any, path: str, problems: list[str]) -> Any:
    """An instance of dataclass `cls` from a mapping, or _INVALID after recording why."""
    if data is None:  # an empty section (`health:`) means all defaults
        data = {}
    if not isinstance(data, dict):
        return _wrong("a mapping", data, path or "top level", problems)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    prefix = f"{path}." if path else ""
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"{prefix}{key}: unknown key{hint}")
    values = {}
    for name, f in fields.items():
        where = prefix + name
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                problems.append(f"{where}: {f.metadata.get('missing', 'required key is missing')}")
                values[name] = _INVALID
            continue
        value = _convert(hints[name], data[name], where, problems)
        check = f.metadata.get("check")
        if check is not None and value is not _INVALID and value is not None:
            try:
                value = check(value)
            except ConfigError as e:
                problems.extend(where + p for p in e.problems)
                value = _INVALID
            except ValueError as e:
                problems.append(f"{where}: {e}")
                value = _INVALID
        values[name] = value
    if _INVALID in values.values():
        return _INVALID
    return cls(**values)


# --- entry points -----------------------------------------------------------------------------


def parse_settings(data: Any) -> Settings:
    """Validate an already-parsed YAML document; raise ConfigError listing every problem."""
    problems: list[str] = []
    settings = _build(Settings, data, "", problems)
    if not problems and not settings.replicas and not settings.replica_sets:
        problems.append("replicas: at least one replica is required")
    if not problems:
        problems += _unservable_roles(settings)
        classes = {c.name for c in settings.flow_control.classes}
        problems += [f"auth.tenants[{i}].priority: {t.priority!r} is not one of flow_control.classes"
                     for i, t in enumerate(settings.auth.tenants) if t.priority is not None and t.priority not in classes]
    if problems:
        raise ConfigError(problems)
    return settings


def _unservable_roles(settings: Settings) -> list[str]:
    """A model whose configured replicas carry roles but make no pair, and none of which can
    serve a request alone with SGLang's protocol (where a prefill or a decode server cannot),
    would refuse every request (503 `no_replica_pair`): a configuration error, said at start.
    A replica without a `model` may serve any model, so it counts towards every one; a
    replica set's members serve both halves."""
    if settings.disaggregation.protocol != "sglang":
        return []  # with vLLM's every engine serves a request whole
    members = [(r.model, r.role) for r in settings.replicas] + [(s.model, "both") for s in settings.replica_sets]
    anyone = [role for model, role in members if model is None]
    roles_of: dict[str | None, list[str]] = {}
    for model, role in members:
        roles_of.setdefault(model, list(anyone) if model is not None else [r for _, r in members])
        if model is not None:
            roles_of[model].append(role)
    problems = []
    for model, roles in roles_of.items():
        has = set(roles)
        if "both" in has or has >= {"prefill", "decode"} or not has & {"prefill", "decode"}:
            continue
        present, missing = ("prefill", "decode") if "prefill" in has else ("decode", "prefill")
        whose = f"model {model!r}" if model is not None else "the replicas without a model"
        problems.append(f"replicas: {whose}: {present} replicas but no {missing} replica nor one of role both; "
                        "with SGLang's protocol none of its requests could be served")
    return problems


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice, where PyYAML would silently keep the last."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict:
    seen = set()
    for key_node, _ in node.value:
        if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
            key = loader.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"duplicate key {key!r}", key_node.start_mark,
                )
            seen.add(key)
    return loader.construct_mapping(node)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_settings(path: str | os.PathLike[str]) -> Settings:
    """Read and validate a YAML file; every problem in the ConfigError starts with the path."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as f:
            data = yaml.load(f, Loader=_StrictLoader)
    except FileNotFoundError:
        raise ConfigError([f"{name}: no such file"]) from None
    except OSError as e:
        raise ConfigError([f"{name}: cannot read: {e.strerror}"]) from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError([f"{name}: {where}invalid YAML: {e.problem}"]) from None
    except yaml.YAMLError as e:
        raise ConfigError([f"{name}: invalid YAML: {e}"]) from None
    try:
        return parse_settings(data)
    except ConfigError as e:
        raise ConfigError([f"{name}: {p}" for p in e.problems]) from None


def settings_from_args(
    replica_urls: list[str],
    policy: str = "predictive",
    host: str = "127.0.0.1",
    port: int = 8000,
) -> Settings:
    """Settings for `kvlb serve --replica URL ...`, validated exactly like a file."""
    return parse_settings(
        {
            "listen": {"host": host, "port": port},
            "replicas": [{"url": url} for url in replica_urls],
            "policy": {"name": policy},
        }
    )


def check_config_main(path: str | os.PathLike[str]) -> int:
    """`kvlb check-config FILE`: print every problem and return 1, or a summary and return 0."""
    try:
        settings = load_settings(path)
    except ConfigError as e:
        for problem in e.problems:
            print(problem)
        return 1
    n = len(settings.replicas)
    print(f"ok: {n} replica{'' if n == 1 else 's'}, policy {settings.policy.name}")
    return 0
