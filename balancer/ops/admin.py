"""The admin API, JSON under /admin/: see the fleet's state, add, drain and remove replicas.

Off unless `admin.token_env` names a variable holding a token; every call must carry it as
`Authorization: Bearer TOKEN` (compared in constant time). Replica addresses enter kvlb only
through configuration and this API, never from a client request.
"""

from __future__ import annotations

import asyncio
import hmac
import os
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import orjson

from balancer.config import ConfigError, parse_settings
from balancer.errors import JSON_HEADERS, ClientError
from balancer.ops.reload import reload_file
from balancer.protocol import ADMIN_PREFIX
from balancer.routing.fleet import Replica
from balancer.routing.request import parse_json_object
from balancer.wire.server import Request

if TYPE_CHECKING:
    from balancer.app import Balancer

PREFIX = ADMIN_PREFIX


class AdminApi:
    def __init__(self, balancer: Balancer) -> None:
        self.balancer = balancer
        env = balancer.settings.admin.token_env
        token = os.environ.get(env) if env else None
        if env and not token:
            raise ConfigError([f"admin.token_env: environment variable {env} is not set"])
        self.token = token.encode() if token else None

    @property
    def enabled(self) -> bool:
        return self.token is not None

    def handle(self, request: Request) -> None:
        try:
            self.authorize(request.header("authorization"))
            status, body = self._route(request)
        except ClientError as exc:
            request.respond(exc.status, exc.headers(), exc.body())
            return
        request.respond(status, JSON_HEADERS, orjson.dumps(body))

    def authorize(self, authorization: str | None) -> None:
        """Raises 401 unless `authorization` carries the admin token."""
        assert self.token is not None
        presented = (authorization or "")[len("Bearer "):].strip().encode()
        if not (authorization or "").lower().startswith("bearer ") or not hmac.compare_digest(presented, self.token):
            raise ClientError(401, "the admin API needs its own token: Authorization: Bearer TOKEN", "invalid_admin_token")

    def _route(self, request: Request) -> tuple[int, Any]:
        # Names may hold '/' (DNS members are HOST/ADDRESS:PORT): a path names them
        # percent-encoded, so each segment is decoded after splitting.
        parts = [unquote(part) for part in request.path[len(PREFIX):].strip("/").split("/")]
        method = request.method
        if parts == ["reload"] and method == "POST":
            return 200, self._reload()
        if parts == ["replicas"]:
            if method == "GET":
                return 200, {"replicas": [self._state(r) for r in self.balancer.fleet.replicas]}
            if method == "POST":
                return 201, self._add(request.body)
        elif len(parts) == 2 and parts[0] == "replicas":
            replica = self._replica(parts[1])
            if method == "GET":
                return 200, self._state(replica)
            if method == "DELETE":
                self.balancer.left(self.balancer.fleet.remove(replica.name))
                return 200, {"removed": replica.name, "in_flight": replica.in_flight}
        elif len(parts) == 3 and parts[0] == "replicas" and parts[2] in ("drain", "undrain"):
            replica = self._replica(parts[1])
            if method == "POST":
                replica.draining = parts[2] == "drain"
                return 200, self._state(replica)
        else:
            raise ClientError(404, f"Invalid URL ({method} {request.path})", "unknown_url")
        raise ClientError(405, f"method {method} is not allowed on {request.path}", "method_not_allowed")

    def _reload(self) -> dict[str, Any]:
        path = self.balancer.config_path
        if path is None:
            raise ClientError(409, "started without --config: there is no file to reload", "no_config_file")
        try:
            return reload_file(self.balancer, path)
        except ConfigError as exc:
            raise ClientError(400, "reload rejected, the running configuration stays: "
                              + "; ".join(exc.problems), "invalid_config") from None

    def _replica(self, name: str) -> Replica:
        replica = self.balancer.fleet.by_name.get(name)
        if replica is None:
            raise ClientError(404, f"no replica named {name!r}", "replica_not_found")
        return replica

    def _add(self, body: bytes) -> dict[str, Any]:
        data = parse_json_object(body)
        try:
            # The same validation as the YAML file's replicas[] entries.
            settings = parse_settings({"replicas": [data]}).replicas[0]
        except ConfigError as exc:
            raise ClientError(400, "; ".join(exc.problems), "invalid_replica") from None
        try:
            replica = self.balancer.fleet.add(settings)
        except ValueError as exc:
            raise ClientError(409, str(exc), "replica_exists") from None
        self.balancer.joined(replica)
        return self._state(replica)

    def _state(self, replica: Replica) -> dict[str, Any]:
        now = asyncio.get_running_loop().time()
        tracker = self.balancer.tracker
        indexed = 0
        if tracker is not None:
            indexed = int(tracker.index.entries_of(replica.name) * tracker.index.block_tokens_of(replica.name))
        return {
            "name": replica.name,
            "url": replica.url,
            "model": replica.declared_model,
            "models": sorted(replica.discovered_models or ()),
            "labels": dict(replica.labels),
            "weight": replica.weight,
            "healthy": replica.healthy,
            "breaker": replica.breaker.state(now),
            "draining": replica.draining,
            "in_flight": replica.in_flight,
            "prefill_tokens_queued": replica.prefill_tokens_queued,
            "decoding": replica.decoding,
            "indexed_tokens": indexed,
        }
