"""Benchmarks: `python -m pddgw.bench.<name> [--json]`, ratios measured side by side."""
