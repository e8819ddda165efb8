"""Chunked bodies decode the same however the bytes are split on the wire."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from balancer.wire.chunked import ChunkedDecoder, ChunkedError, ChunkedTooLarge


def encode(pieces: list[bytes], trailers: bytes = b"") -> bytes:
    return b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in pieces if p) + b"0\r\n" + trailers + b"\r\n"


@given(
    pieces=st.lists(st.binary(min_size=1, max_size=300), max_size=8),
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=10),
    after=st.binary(max_size=20),
)
def test_any_split_gives_the_body_and_what_follows(pieces, cuts, after) -> None:
    wire = encode(pieces, b"X-Trailer: 1\r\n") + after
    points = sorted({c % (len(wire) + 1) for c in cuts})
    decoder, body, rest = ChunkedDecoder(), b"", b""
    for start, end in zip([0, *points], [*points, len(wire)], strict=True):
        if decoder.done:
            rest += wire[start:end]
            continue
        out, tail = decoder.feed(wire[start:end])
        body += b"".join(out)
        rest += tail
    assert decoder.done
    assert body == b"".join(pieces)
    assert rest == after


@pytest.mark.parametrize("wire", [b"zz\r\n", b"5\r\nhelloXX", b"\r\n", b"-1\r\n"])
def test_malformed_bodies_raise(wire: bytes) -> None:
    with pytest.raises(ChunkedError):
        ChunkedDecoder().feed(wire)


def test_limits() -> None:
    with pytest.raises(ChunkedTooLarge):
        ChunkedDecoder().feed(b"1" * 2000)
    with pytest.raises(ChunkedTooLarge):
        ChunkedDecoder(max_trailer_bytes=100).feed(b"0\r\nX: " + b"y" * 200 + b"\r\n")
