"""Shared by the tests and the benchmarks: vLLM's scheduler, built in-process."""
