"""Child processes that must not outlive the process that started them."""

from __future__ import annotations

import ctypes
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Runs in the child before exec: if its parent is killed outright (no cleanup runs),
    # the kernel sends it SIGTERM.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def dies_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` for subprocess.Popen: the child gets SIGTERM when its parent dies
    (Linux; elsewhere None, and the caller's own cleanup is all there is)."""
    return _die_with_parent if sys.platform == "linux" else None
