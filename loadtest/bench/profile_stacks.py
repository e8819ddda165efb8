"""Where a profiled kvlb spent its time, by function and by part of the relay path.

Reads collapsed stacks (`frame;frame;... count` a line), as `py-spy record --format raw`
writes them, e.g. from `python -m loadtest.bench.stream --profile-kvlb 'py-spy record
--nonblocking --format raw -r 500 -p {pid} -o kvlb.stacks'`, and prints each function's own
share of the samples (time in C code it called, a socket write for one, counts as its own),
its share with everything it called, and the shares of the parts of the streaming path.

    python -m loadtest.bench.profile_stacks kvlb.stacks [--top 30]
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

_LINE = re.compile(r":\d+\)$")

# First match wins, tried in this order on a sample's innermost kvlb-or-asyncio frame.
PARTS = (
    ("usage parsing (balancer/serving/usage.py)", ("balancer/serving/usage.py",)),
    ("chunked decoding (balancer/wire/chunked.py)", ("balancer/wire/chunked.py",)),
    ("http_server write path (ResponseStream, transport writes)", ("ResponseStream.", "_Connection.drain",
                                                                  "_Connection._write_head",
                                                                  "_Connection.start_stream")),
    ("upstream reading (upstream.py: data_received, parse, feed, wake)", ("balancer/wire/client.py",)),
    ("stream idle timer (asyncio.Timeout.reschedule)", ("Timeout.", "asyncio/timeouts.py")),
    ("relay loop (Proxy._relay)", ("Proxy._relay",)),
    ("request start/end (server, proxy.forward, routing, metrics)", ("balancer/", "policies/")),
    ("event loop itself (uvloop C code, epoll, task steps, callbacks)", ("Runner.run", "uvloop/", "asyncio/")),
)


def function(frame: str) -> str:
    """`name (file:line)` -> `name (file)`: one row per function, not per line."""
    return _LINE.sub(")", frame)


def part_of(frames: list[str]) -> str:
    for frame in reversed(frames):
        for name, marks in PARTS:
            if any(mark in frame for mark in marks):
                return name
    return "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stacks")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    total = 0
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    parts: Counter[str] = Counter()
    with open(args.stacks) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            n = int(count)
            frames = [function(frame) for frame in stack.split(";")]
            total += n
            own[frames[-1]] += n
            for frame in set(frames):
                inclusive[frame] += n
            parts[part_of(frames)] += n
    if not total:
        raise SystemExit(f"{args.stacks}: no samples")
    print(f"{total} samples")
    print(f"\n{'own':>6} {'with callees':>12}  function")
    for name, n in own.most_common(args.top):
        print(f"{n / total:>6.1%} {inclusive[name] / total:>12.1%}  {name}")
    print("\nby part of the path (each sample counted once, by its innermost frame that names a part):")
    for name, n in parts.most_common():
        print(f"{n / total:>6.1%}  {name}")


if __name__ == "__main__":
    main()
