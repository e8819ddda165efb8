"""JSON numbers past a double's or a 64-bit integer's range are valid JSON, and the engines'
parsers read them: kvlb forwards such a body byte for byte instead of refusing it."""

from __future__ import annotations

from contextlib import AsyncExitStack

import aiohttp
import orjson
import pytest

from tests.conftest import make_settings, run_balancer, serve_app
from tests.upstreams import Seen, echo_app

WIDE = [
    ("/v1/completions",
     b'{"model": "m", "prompt": "hi", "seed": 123456789012345678901234567890, "temperature": 1e400}'),
    ("/v1/chat/completions",
     b'{"model":"m","messages":[{"role":"user","content":"hi \\ud83d\\ude00"}],'
     b'"logit_bias":{"50256":-1E+400},"max_tokens":18446744073709551616}'),
    ("/generate", b'{"text": "hi", "sampling_params": {"temperature": 2e308, "seed": -99999999999999999999999}}'),
    ("/v1/completions", b'{"model": "m", "prompt": [1, 2, 3], "seed": 1' + b"0" * 400 + b"}"),
    ("/v1/completions", b'{"model": "m", "prompt": "x", "n": 1' + b"0" * 5000 + b"}"),
]  # fmt: skip

# Each refused with orjson's own message; the wide number must neither excuse the fault nor be
# blamed for it.
STILL_REFUSED = [
    (b'{"model": "m", "temperature": 1e400, "x": NaN}', "NaN"),
    (b'{"model": "m", "temperature": 1e400, "x": Infinity}', "Infinity"),
    (b'{"model": "m", "temperature": 1e400, "x": [1,]}', "Expecting value"),
    (b'{"model": "m", "temperature": 1e400} trailing', "Extra data"),
    (b'{"model": "m", "temperature": 1e400, "x": 012}', "delimiter"),
    (b'{"model": "m", "temperature": 1e400, "x": "\\ud800"}', "surrogate"),
    (b'{"model": "m", "temperature": 1e400, "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nested"),
]  # fmt: skip


@pytest.mark.parametrize("policy", ["least_load", "cache_aware", "predictive"])
async def test_wide_numbers_are_forwarded_byte_for_byte(policy):
    seen = Seen()
    async with AsyncExitStack() as stack:
        url = await stack.enter_async_context(serve_app(echo_app(seen)))
        kvlb = await stack.enter_async_context(run_balancer(make_settings([url], policy={"name": policy})))
        http = await stack.enter_async_context(aiohttp.ClientSession())
        for route, body in WIDE:
            async with http.post(kvlb.url + route, data=body, headers={"Content-Type": "application/json"}) as resp:
                assert resp.status == 200, (body[:80], await resp.text())
                assert await resp.read() == body
    assert seen.bodies == [body for _, body in WIDE]


async def test_other_faults_in_a_body_with_wide_numbers_are_still_refused():
    seen = Seen()
    async with AsyncExitStack() as stack:
        url = await stack.enter_async_context(serve_app(echo_app(seen)))
        kvlb = await stack.enter_async_context(run_balancer(make_settings([url], policy={"name": "cache_aware"})))
        http = await stack.enter_async_context(aiohttp.ClientSession())
        for body, fault in STILL_REFUSED:
            async with http.post(kvlb.url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"}) as resp:
                error = orjson.loads(await resp.read())["error"]
                assert resp.status == 400, body[:80]
                assert error["code"] == "invalid_json" and fault in error["message"], (body[:80], error)
                assert "infinity" not in error["message"], error
        # Without a wide number the answer is orjson's, as before.
        plain = b'{"model": "m", "x": [1,]}'
        with pytest.raises(orjson.JSONDecodeError) as refused:
            orjson.loads(plain)
        async with http.post(kvlb.url + "/v1/completions", data=plain,
                             headers={"Content-Type": "application/json"}) as resp:
            error = orjson.loads(await resp.read())["error"]
            assert resp.status == 400
            assert error["message"] == f"request body is not valid JSON: {refused.value}"
    assert seen.requests == 0
