"""Client API keys: who may use the balancer, and which key the replicas see.

Keys come from the configuration, a file, or an environment variable, and are read once at
start. Each presented key is compared with every configured key in constant time, so the
answer's timing says nothing about how much of a key was right. Keys never reach a log line
or a metric label.
"""

from __future__ import annotations

import hmac
import math
import os
from pathlib import Path

from balancer.config import AuthSettings, ConfigError
from balancer.errors import ClientError

BEARER = "bearer "


def load_keys(settings: AuthSettings) -> tuple[bytes, ...]:
    keys = list(settings.api_keys)
    if settings.api_keys_file:
        try:
            text = Path(settings.api_keys_file).read_text()
        except OSError as exc:
            raise ConfigError([f"auth.api_keys_file: cannot read {settings.api_keys_file!r}: {exc.strerror}"]) from None
        keys += [line.split("#", 1)[0].strip() for line in text.splitlines()]
    if settings.api_keys_env:
        keys += _env_keys(settings.api_keys_env, "auth.api_keys_env")
    return tuple(key.encode() for key in keys if key)


def _env_keys(variable: str, where: str) -> list[str]:
    """The comma-separated keys an environment variable holds."""
    value = os.environ.get(variable)
    if value is None:
        raise ConfigError([f"{where}: environment variable {variable} is not set"])
    return [part.strip() for part in value.split(",")]


def tenant_keys(settings: AuthSettings) -> list[tuple[bytes, str]]:
    """Each tenant's keys, with the tenant they identify."""
    out = []
    for tenant in settings.tenants:
        keys = list(tenant.api_keys)
        if tenant.api_keys_env:
            keys += _env_keys(tenant.api_keys_env, f"auth.tenants: {tenant.name}")
        out += [(key.encode(), tenant.name) for key in keys if key]
    return out


def authenticator(settings: AuthSettings) -> Authenticator:
    """The keys of `settings`, loose and grouped by tenant, with their rate limit."""
    loose = load_keys(settings)
    grouped = tenant_keys(settings)
    tenants = {f"key-{len(loose) + i}": tenant for i, (_, tenant) in enumerate(grouped)}
    return Authenticator(loose + tuple(key for key, _ in grouped), settings.rate_limit_per_s,
                         settings.rate_limit_burst, tenants)


def replica_key(settings: AuthSettings) -> str | None:
    if not settings.replica_api_key_env:
        return None
    value = os.environ.get(settings.replica_api_key_env)
    if not value:
        raise ConfigError([f"auth.replica_api_key_env: environment variable {settings.replica_api_key_env} is not set"])
    return value


class TokenBucket:
    """`rate` requests a second on average, up to `burst` at once."""

    __slots__ = ("rate", "burst", "tokens", "updated")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst, self.tokens, self.updated = rate, burst, burst, now

    def take(self, now: float) -> float:
        """0 when a request may go now, else the seconds until one may."""
        # A clock that steps back (or a caller on another clock) must not drain the bucket.
        self.tokens = min(self.burst, self.tokens + max(now - self.updated, 0.0) * self.rate)
        self.updated = max(now, self.updated)
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate


class Authenticator:
    def __init__(self, keys: tuple[bytes, ...], rate_per_s: float | None = None, burst: int | None = None,
                 tenants: dict[str, str] | None = None) -> None:
        self.keys = keys
        # A key's identity → its tenant, for keys configured under a tenant.
        self.tenants = tenants or {}
        self.rate_per_s = rate_per_s
        self.burst = burst if burst is not None else max(1.0, rate_per_s or 1.0)
        # One bucket per configured key: bounded by the configuration, not by traffic.
        self._buckets: dict[int, TokenBucket] = {}

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def tenant_of(self, identity: str | None) -> str | None:
        return self.tenants.get(identity) if identity is not None else None

    def check(self, authorization: str | None, now: float) -> str | None:
        """The client's identity (which key, never the key itself), or None when kvlb is
        open; raise 401 for a missing or wrong key, 429 for a key over its rate. `now` is
        the event loop's clock, the one every bucket is kept on."""
        if not self.keys:
            return None
        if not authorization or not authorization.lower().startswith(BEARER):
            raise ClientError(
                401, "You didn't provide an API key: send Authorization: Bearer YOUR_KEY", "missing_api_key"
            )
        presented = authorization[len(BEARER):].strip().encode()
        matched = -1
        for index, key in enumerate(self.keys):  # no early exit: every key costs the same time
            if hmac.compare_digest(presented, key):
                matched = index
        if matched < 0:
            raise ClientError(401, "Incorrect API key provided", "invalid_api_key")
        if self.rate_per_s is not None:
            bucket = self._buckets.get(matched)
            if bucket is None:
                bucket = self._buckets[matched] = TokenBucket(self.rate_per_s, self.burst, now)
            wait = bucket.take(now)
            if wait > 0:
                raise ClientError(
                    429, "Rate limit reached for this API key; retry after the time in Retry-After",
                    "rate_limit_exceeded", type_="rate_limit_error", retry_after=max(1, math.ceil(wait)),
                )
        return f"key-{matched}"
