"""Bad requests get 400 (413 for huge bodies) in the OpenAI error shape, never a 500."""

import aiohttp
import hypothesis.strategies as st
import openai
import pytest
from hypothesis import HealthCheck, given, settings

from loadtest.replica.config import ReplicaConfig
from loadtest.replica.launch import running_replica

ROUTES = ("/v1/chat/completions", "/v1/completions", "/generate")


@pytest.fixture
async def replica():
    config = ReplicaConfig(time_scale=1000, context_limit=2048, max_body_bytes=64 * 1024)
    async with running_replica(config) as server:
        yield server


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


async def post(http, url, body: bytes | dict) -> tuple[int, dict]:
    kwargs = {"json": body} if isinstance(body, dict | list) else {"data": body}
    async with http.post(url, **kwargs) as response:
        return response.status, await response.json(content_type=None)


def assert_openai_error(status: int, payload: dict, expected_status: int = 400) -> dict:
    assert status == expected_status, payload
    error = payload["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    assert "code" in error
    return error


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("body", [b"{not json", b"", b"[1, 2]", b'"text"', b"\xff\xfe"])
async def test_malformed_json(replica, http, route, body):
    status, payload = await post(http, replica.url + route, body)
    assert_openai_error(status, payload)


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/chat/completions", {}),
        ("/v1/chat/completions", {"messages": "hi"}),
        ("/v1/chat/completions", {"messages": []}),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "max_tokens": "5"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": "yes"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": 7}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "stream_options": "usage"},
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
        ),
        ("/v1/completions", {}),
        ("/v1/completions", {"prompt": 5}),
        ("/v1/completions", {"prompt": ""}),
        ("/v1/completions", {"prompt": ["a", "b"]}),
        ("/v1/completions", {"prompt": [1, -2]}),
        ("/generate", {}),
        ("/generate", {"text": "a", "input_ids": [1]}),
        ("/generate", {"text": ["a", "b"]}),
        ("/generate", {"input_ids": ["a"]}),
        ("/generate", {"text": "a", "sampling_params": []}),
        ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": -1}}),
    ],
)
async def test_invalid_fields(replica, http, route, body):
    status, payload = await post(http, replica.url + route, body)
    assert_openai_error(status, payload)


async def test_context_length_exceeded_like_vllm(replica, http):
    long_prompt = " ".join(["w"] * 2100)  # the replica's context limit is 2,048
    status, payload = await post(http, replica.url + "/v1/completions", {"prompt": long_prompt})
    assert assert_openai_error(status, payload)["code"] == "context_length_exceeded"
    # Prompt fits, prompt plus max_tokens does not.
    body = {"prompt": " ".join(["w"] * 2000), "max_tokens": 100}
    status, payload = await post(http, replica.url + "/v1/completions", body)
    assert assert_openai_error(status, payload)["code"] == "context_length_exceeded"
    # Prompt fits and no max_tokens: the default shrinks to the room that is left.
    body = {"prompt": " ".join(["w"] * 2040)}
    status, payload = await post(http, replica.url + "/v1/completions", body)
    assert status == 200 and payload["usage"]["completion_tokens"] == 8

    sdk = openai.AsyncOpenAI(base_url=replica.url + "/v1", api_key="x", max_retries=0)
    try:
        with pytest.raises(openai.BadRequestError) as raised:
            await sdk.chat.completions.create(
                model="m", messages=[{"role": "user", "content": long_prompt}]
            )
        assert raised.value.code == "context_length_exceeded"
    finally:
        await sdk.close()


async def test_prompt_larger_than_the_kv_cache(http):
    config = ReplicaConfig(time_scale=1000, kv_capacity_tokens=1024)
    async with running_replica(config) as server:
        body = {"text": " ".join(["w"] * 1500), "sampling_params": {"max_new_tokens": 1}}
        status, payload = await post(http, server.url + "/generate", body)
        assert assert_openai_error(status, payload)["code"] == "context_length_exceeded"


async def test_oversized_body(replica, http):
    body = {"prompt": "w " * 40_000}  # 80 kB, over the 64 kB limit
    status, payload = await post(http, replica.url + "/v1/completions", body)
    assert_openai_error(status, payload, expected_status=413)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 3)
    | st.floats(allow_nan=False)
    | st.text(max_size=5),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=8,
)
fields = st.fixed_dictionaries(
    {},
    optional={
        "messages": json_values,
        "prompt": json_values,
        "text": json_values,
        "input_ids": json_values,
        "max_tokens": json_values,
        "stream": json_values,
        "stream_options": json_values,
        "sampling_params": json_values,
        "n": json_values,
    },
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(route=st.sampled_from(ROUTES), body=fields)
async def test_no_body_shape_causes_a_500(replica, http, route, body):
    status, _ = await post(http, replica.url + route, body)
    assert status in (200, 400)


async def test_an_unknown_route_or_method_is_answered_in_json_as_the_engines_framework_does(replica, http):
    status, payload = await post(http, replica.url + "/v1/embeddings", {"model": "m", "input": "hi"})
    assert (status, payload) == (404, {"detail": "Not Found"})
    async with http.delete(replica.url + "/v1/models") as response:
        assert response.status == 405 and "GET" in response.headers["Allow"]
        assert await response.json() == {"detail": "Method Not Allowed"}
