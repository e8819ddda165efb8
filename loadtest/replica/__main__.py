import sys

from loadtest.replica.cli import run

sys.exit(run())
