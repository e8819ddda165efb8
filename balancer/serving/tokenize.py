"""Precise mode without a local tokenizer: ask an engine's own `/tokenize`."""

from __future__ import annotations

import logging

import aiohttp
import orjson

from balancer.routing.fleet import Replica

log = logging.getLogger("kvlb.tokenize")


async def tokenize_remotely(
    session: aiohttp.ClientSession, replica: Replica, body: bytes, authorization: str | None, timeout_s: float
) -> list[int] | None:
    """The prompt's token ids from `replica`, or None when it cannot answer in time: routing
    then goes on without a prediction."""
    headers = {"content-type": "application/json"}
    if authorization is not None:
        headers["authorization"] = authorization
    try:
        async with session.post(
            replica.url + "/tokenize", data=bytes(body), headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as answer:
            if answer.status != 200:
                return None
            tokens = orjson.loads(await answer.read()).get("tokens")
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, AttributeError) as exc:
        log.debug("tokenize on %s failed: %r", replica.name, exc)
        return None
    if isinstance(tokens, list) and all(isinstance(t, int) and 0 <= t < 1 << 32 for t in tokens):
        return tokens
    return None
