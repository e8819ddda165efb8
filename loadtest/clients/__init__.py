"""Standard benchmark clients (aiperf) run against kvlb offline: their environment, a local
tokenizer that counts as the simulated replica does, and their results read back."""
