"""Client API keys: who may use the balancer, and which key the replicas see.

Keys come from the configuration, a file, or an environment variable, and are read once at
start. Each presented key is compared with every configured key in constant time, so the
answer's timing says nothing about how much of a key was right. Keys never reach a log line
or a metric label.
"""

from __future__ import annotations

import hmac
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
        value = os.environ.get(settings.api_keys_env)
        if value is None:
            raise ConfigError([f"auth.api_keys_env: environment variable {settings.api_keys_env} is not set"])
        keys += [part.strip() for part in value.split(",")]
    return tuple(key.encode() for key in keys if key)


def replica_key(settings: AuthSettings) -> str | None:
    if not settings.replica_api_key_env:
        return None
    value = os.environ.get(settings.replica_api_key_env)
    if not value:
        raise ConfigError([f"auth.replica_api_key_env: environment variable {settings.replica_api_key_env} is not set"])
    return value


class Authenticator:
    def __init__(self, keys: tuple[bytes, ...]) -> None:
        self.keys = keys

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def check(self, authorization: str | None) -> None:
        if not self.keys:
            return
        if not authorization or not authorization.lower().startswith(BEARER):
            raise ClientError(
                401, "You didn't provide an API key: send Authorization: Bearer YOUR_KEY", "missing_api_key"
            )
        presented = authorization[len(BEARER):].strip().encode()
        match = False
        for key in self.keys:  # no early exit: every key costs the same time
            match |= hmac.compare_digest(presented, key)
        if not match:
            raise ClientError(401, "Incorrect API key provided", "invalid_api_key")
