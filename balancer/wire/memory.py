"""Hand memory freed by large request bodies back to the system.

A body is freed the moment its connection or its answer ends, but glibc's allocator keeps
what it freed for reuse: after a burst of large uploads (aborted or not) the process would
stay hundreds of MiB above its working size, which looks like a leak to whoever watches it
and counts against a container's memory limit. `malloc_trim` returns those pages; it costs
about a millisecond, so it runs at most once per `TRIM_DELAY_S`, and only after a large body
went. Elsewhere than glibc this is a no-op.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging

log = logging.getLogger("kvlb.memory")

# Bodies at least this large are worth a trim once gone; small ones are reused as they are.
LARGE_BODY_BYTES = 1 << 20
TRIM_DELAY_S = 0.5


def _load_malloc_trim():  # noqa: ANN202
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None  # not glibc: its allocator returns memory its own way
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_malloc_trim = _load_malloc_trim()
_pending: asyncio.TimerHandle | None = None


def large_body_freed() -> None:
    """A large body was let go: trim soon, once for however many go meanwhile."""
    global _pending
    if _malloc_trim is None or _pending is not None:
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    _pending = loop.call_later(TRIM_DELAY_S, _trim)


def _trim() -> None:
    global _pending
    _pending = None
    if _malloc_trim is not None:
        _malloc_trim(0)
