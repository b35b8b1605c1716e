"""Benchmark tooling: workload datasets (ShareGPT, random, prefix-sharing, multi-turn)."""
