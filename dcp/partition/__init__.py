"""Hypergraph partitioning: the value type, the partitioners, and a time-budgeted runner."""
from dcp.partition.backends import (PARTITIONER_NAMES, GreedyPartitioner, KaHyParPartitioner, MtKaHyParPartitioner,
                                    Partitioner, named_partitioner, run_partitioner)
from dcp.partition.worker import WORKER, PartitionerTimeout
from dcp.partition.hypergraph import Hypergraph, scale_to_int32

__all__ = ["PARTITIONER_NAMES", "named_partitioner", "Hypergraph", "Partitioner", "KaHyParPartitioner", "MtKaHyParPartitioner", "GreedyPartitioner",
           "PartitionerTimeout", "WORKER", "run_partitioner", "scale_to_int32"]
