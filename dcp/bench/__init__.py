"""Benchmarks at cluster scale through the simulator: ``dcp bench micro|dryrun|megatron``."""
