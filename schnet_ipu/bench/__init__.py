"""Benchmarks: ``python -m schnet_ipu.bench SUITE [--quick] [--json PATH] [--out-dir DIR]``."""
