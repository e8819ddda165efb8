"""`python -m balancer ...` is the `kvlb` command."""

from balancer.process.cli import main

raise SystemExit(main())
