"""Request ids a client sends are kept only when they are safe to repeat: in answers, in
access log lines (text or JSON), anywhere a reader might trust them."""

from __future__ import annotations

import re

import orjson
import pytest

from tests.abuse.harness import (
    CHAT,
    JSON,
    GoodClient,
    RawConn,
    chat_body,
    post,
    request_bytes,
    sim_replicas,
    under_attack,
    wait_until,
)

SAFE_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")
UNSAFE = ["abc status=200 replica=evil", 'abc"def', "x" * 500]
SAFE = ["req-1.a_b:c@d/e+f=g", "y" * 128]


def as_logged(value: str) -> list[str]:
    """The ways `value` can appear in a log line: as is, and escaped inside a JSON string."""
    return [value, orjson.dumps(value).decode()[1:-1]]


@pytest.mark.parametrize("log_format", ["text", "json"])
async def test_unsafe_request_ids_are_replaced_in_answers_and_access_logs(kvlb, sim, log_format) -> None:
    k = kvlb({"replicas": sim_replicas(sim), "logging": {"access_log": True, "format": log_format}})
    async with under_attack(k, GoodClient(k.port)):
        problems = []
        for sent in UNSAFE + SAFE:
            answer = await post(k.port, CHAT, chat_body(), [JSON, ("x-request-id", sent)])
            assert answer.status == 200, answer
            got = answer.header("x-request-id")
            if sent in SAFE and got != sent:
                problems.append(f"safe id {sent!r} answered as {got!r}")
            elif sent in UNSAFE and got == sent:
                problems.append(f"unsafe id {sent[:40]!r} answered as sent")
            elif not (got and SAFE_ID.fullmatch(got)):
                problems.append(f"unsafe id {sent[:40]!r} answered as {got!r}, not a safe id either")
        await wait_until(lambda: all(s in k.log() for s in SAFE), 3, "the access log has the safe ids")
        log = k.log()
        problems += [f"unsafe id {sent[:40]!r} in the {log_format} access log"
                     for sent in UNSAFE if any(form in log for form in as_logged(sent))]
        assert not problems, problems


async def test_requests_refused_while_being_read_do_not_echo_unsafe_ids(kvlb, sim) -> None:
    k = kvlb({"replicas": sim_replicas(sim)})
    async with under_attack(k, GoodClient(k.port)):
        for sent in UNSAFE:
            conn = await RawConn.open(k.port)
            # The head is read, so kvlb knows the id; the body's framing is broken.
            head = request_bytes("POST", CHAT, headers=[JSON, ("Transfer-Encoding", "chunked"),
                                                        ("x-request-id", sent)], length=False)
            await conn.send(head + b"zz\r\n")
            answer = await conn.answer_within(3.0, "a request with a broken chunk size")
            conn.close()
            assert answer.status == 400, answer
            got = answer.header("x-request-id")
            assert got != sent, f"an unsafe id came back as sent: {sent!r}"
            assert got and SAFE_ID.fullmatch(got), f"kvlb's own id {got!r} is not a safe id"
