"""Sequence-length data: synthetic length distributions, paper-style batching and user length files.

``longalign`` and ``ldc`` are synthetic approximations of the paper's datasets (see
``dcp.data.lengths``); ``megatron_mock`` is Megatron-Core's Dynamic CP mock benchmark distribution.
"""
from dcp.data.lengths import (
    DEFAULT_TOKENS_PER_BATCH,
    DISTRIBUTIONS,
    LDC,
    LONGALIGN,
    MEGATRON_MOCK,
    PAPER_SCALES,
    BatchFormationError,
    LengthDistribution,
    LogNormalComponent,
    get_distribution,
    load_length_batches,
    lognormal,
    make_batches,
    parse_lengths_arg,
)

__all__ = [
    "DEFAULT_TOKENS_PER_BATCH",
    "DISTRIBUTIONS",
    "LDC",
    "LONGALIGN",
    "MEGATRON_MOCK",
    "PAPER_SCALES",
    "BatchFormationError",
    "LengthDistribution",
    "LogNormalComponent",
    "get_distribution",
    "load_length_batches",
    "lognormal",
    "make_batches",
    "parse_lengths_arg",
]
