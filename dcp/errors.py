"""Named errors raised by dcp. Every bad input gets one of these, with a message saying what to fix."""


class DcpError(Exception):
    """Base class of every error dcp raises on purpose."""


class InvalidBatchError(DcpError, ValueError):
    """The batch description (lengths, heads, dtype, masks) is malformed."""


class InvalidMaskError(DcpError, ValueError):
    """A mask's parameters or KV ranges are malformed."""


class InvalidClusterError(DcpError, ValueError):
    """The cluster description (nodes, GPUs per node, bandwidths) is malformed."""


class InvalidConfigError(DcpError, ValueError):
    """A planner configuration value is out of range or inconsistent with the batch."""


class TooFewBlocksError(DcpError, ValueError):
    """The batch has fewer token blocks than devices and the config refuses idle devices."""


class PartitionerError(DcpError, RuntimeError):
    """A hypergraph partitioner failed or is not installed."""


class PlanValidationError(DcpError, AssertionError):
    """A plan broke one of its invariants (coverage, matching transfers, merges, deadlock freedom)."""


class InvalidPlanError(DcpError, ValueError):
    """A plan asked for what it does not hold (a layer kind it lacks) or assembled from parts that disagree."""


class SerializationError(DcpError, ValueError):
    """Plan bytes are corrupt, truncated or of an unsupported format version."""


class ExecutionError(DcpError, RuntimeError):
    """An executor was given inputs that do not fit the plan, or a peer failed mid-run."""


class PlanMismatchError(DcpError, RuntimeError):
    """Ranks of one process group hold different plans (or formed different batches): running would
    exchange mismatched messages, so every rank raises this instead, naming the ranks that differ."""


class MemoryBudgetError(DcpError, RuntimeError):
    """No plan keeps every device within the memory budget (``PlannerConfig.strict_memory=True``)."""
