"""Command-line tools over the public API: ``doctor`` (check this build on this machine) and
``bench`` (tokens/s, counters per token, time to first token, memory)."""
