"""The one place kvlb edits a body: only the disaggregation fields change, the rest is kept."""

from __future__ import annotations

import orjson
import pytest

from balancer.errors import ClientError
from balancer.serving import pd_protocol

BODY = b'{"model": "m",  "prompt": "caf\\u00e9 1.50", "max_tokens": 100, "stream": true, "stream_options": {"include_usage": true}}'


def test_sglang_fields_go_first_and_every_other_byte_is_the_clients() -> None:
    out = pd_protocol.sglang_body(BODY, "http://10.0.0.7:30000", 8998, 12345)
    head = b'{"bootstrap_host":"10.0.0.7","bootstrap_port":8998,"bootstrap_room":12345,'
    assert out == head + BODY[1:]
    data = orjson.loads(out)
    assert data["bootstrap_room"] == 12345 and data["prompt"] == "caf\u00e9 1.50"


def test_an_empty_object_and_leading_whitespace_stay_valid() -> None:
    assert orjson.loads(pd_protocol.with_fields_first(b' \n{ }', {"a": 1})) == {"a": 1}
    assert orjson.loads(pd_protocol.with_fields_first(b'\t{"b":2}', {"a": 1})) == {"a": 1, "b": 2}


def test_the_vllm_prefill_request_asks_for_one_token_no_stream_and_remote_decode() -> None:
    data = orjson.loads(pd_protocol.vllm_prefill_body(pd_protocol.parse_object(BODY)))
    assert data["kv_transfer_params"]["do_remote_decode"] is True
    assert data["stream"] is False and data["max_tokens"] == 1 and "stream_options" not in data
    assert data["prompt"] == "caf\u00e9 1.50"
    chat = orjson.loads(pd_protocol.vllm_prefill_body({"messages": [], "max_completion_tokens": 50}))
    assert chat["max_completion_tokens"] == 1


def test_the_vllm_decode_request_is_the_clients_with_the_prefill_answers_params() -> None:
    answer = b'{"choices": [], "kv_transfer_params": {"do_remote_prefill": true, "remote_block_ids": [1, 2]}}'
    params = pd_protocol.vllm_transfer_params(answer)
    assert params == {"do_remote_prefill": True, "remote_block_ids": [1, 2]}
    out = pd_protocol.vllm_decode_body(BODY, params)
    assert out.endswith(BODY[1:]) and orjson.loads(out)["kv_transfer_params"] == params
    assert pd_protocol.vllm_transfer_params(b'{"choices": []}') is None
    assert pd_protocol.vllm_transfer_params(b"not json") is None


@pytest.mark.parametrize("protocol, field", [("sglang", "bootstrap_room"), ("vllm", "kv_transfer_params")])
def test_a_client_that_sets_a_field_of_the_balancers_is_refused(protocol: str, field: str) -> None:
    with pytest.raises(ClientError) as refused:
        pd_protocol.refuse_reserved({"prompt": "x", field: 1}, protocol)
    assert refused.value.status == 400 and refused.value.code == "reserved_field"
    with pytest.raises(ClientError):
        pd_protocol.parse_object(b"[1, 2]")


def test_a_batch_gets_a_room_host_and_port_per_sequence_as_sglangs_router_sends_them() -> None:
    body = b'{"text": ["a", "b", "c"], "sampling_params": {"max_new_tokens": 4}}'
    data = pd_protocol.parse_object(body)
    rooms = pd_protocol.rooms_for(data)
    assert isinstance(rooms, list) and len(set(rooms)) == 3
    out = orjson.loads(pd_protocol.sglang_body(body, "http://10.0.0.7:30000", 8998, rooms))
    assert out["bootstrap_host"] == ["10.0.0.7"] * 3 and out["bootstrap_port"] == [8998] * 3
    assert out["bootstrap_room"] == rooms and out["text"] == ["a", "b", "c"]
    # What counts as a batch: n choices, prompts of strings or of token lists, input_ids lists.
    size = pd_protocol.batch_size
    assert size({"n": 2, "messages": []}) == 2 and size({"n": 1, "prompt": "x"}) is None
    assert size({"prompt": ["x", "y"]}) == 2 and size({"prompt": [[1, 2], [3]]}) == 2
    assert size({"prompt": [1, 2, 3]}) is None  # one prompt of token ids
    assert size({"input_ids": [[1], [2], [3], [4]]}) == 4 and size({"input_ids": [1, 2]}) is None
    assert size({"text": "one"}) is None and isinstance(pd_protocol.rooms_for({"text": "one"}), int)
    with pytest.raises(ClientError) as info:
        size({"n": pd_protocol.MAX_BATCH_ROOMS + 1})
    assert info.value.status == 400 and info.value.code == "batch_too_large"
