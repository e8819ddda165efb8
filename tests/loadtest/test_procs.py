"""Child processes of the harness: CPU read over a whole process tree."""

from __future__ import annotations

import sys
import textwrap
import time

from loadtest.procs import read_cpu_seconds, start_process, stop_process, tree_cpu_seconds

# A parent that only waits, and a child of it that spins for a while, then waits too.
PARENT = textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c",
        "import sys, time\\nend = time.process_time() + 0.4\\nwhile time.process_time() < end: pass\\n"
        "open(sys.argv[1], 'w').close()\\ntime.sleep(60)", sys.argv[1]])
    time.sleep(60)
""")


def test_a_routers_cpu_counts_the_processes_it_started(tmp_path):
    done = tmp_path / "spun"
    parent = start_process([sys.executable, "-c", PARENT, str(done)])
    try:
        deadline = time.monotonic() + 30
        while not done.exists():
            assert time.monotonic() < deadline, "the child never finished spinning"
            time.sleep(0.05)
        own = read_cpu_seconds(parent.pid)
        tree = tree_cpu_seconds(parent.pid)
        # The child's 0.4 s of spinning is in the tree's figure, not in the parent's own.
        assert tree - own >= 0.3
    finally:
        stop_process(parent)
    assert tree_cpu_seconds(parent.pid) == 0.0  # gone: nothing to count, no error
