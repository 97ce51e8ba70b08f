"""Static context-parallel baselines as typed planners emitting plans in dcp's IR.

``RingPlanner`` ("ring"), ``ZigzagPlanner`` ("zigzag"), ``TEA2AP2PPlanner`` ("te_a2a_p2p", Transformer
Engine's hierarchical all-to-all + p2p), ``MegatronCPPlanner`` ("megatron_cp", Megatron-Core's static CP:
data-parallel groups of a fixed CP size), ``MegatronDynCPPlanner`` ("megatron_dyncp", Megatron-Core's
dynamic CP groups) and ``LoongTrainPlanner`` ("loongtrain", 2-D head x context parallelism with a double
ring), ``TorchCPPlanner`` ("torch_cp", PyTorch's context parallelism: per-document head-tail or
processing-time round-robin, all-gathered KV), ``UlyssesPlanner`` ("ulysses", DeepSpeed's all-to-all head
parallelism), ``MagiPlanner`` ("magi", MagiAttention's static dispatch: area-balanced query chunks, KV
multicast, ``degree``-stage overlap) and ``MagiDynamicPlanner`` ("magi_dynamic", its dynamic tile solver). ``BASELINES`` maps names to classes; every class builds with defaults: ``BASELINES[name]()``.
A planner that cannot serve a batch or cluster (Ulysses with more devices than heads) raises
``InvalidConfigError`` naming why; ``Planner.tuning_grid`` lists the knob settings a tuned comparison tries.
"""
from dcp.baselines.loongtrain import LoongTrainPlanner
from dcp.baselines.magi import MagiPlanner
from dcp.baselines.magi_dynamic import MagiDynamicPlanner
from dcp.baselines.megatron_cp import MegatronCPPlanner
from dcp.baselines.megatron_dyncp import MegatronDynCPPlanner
from dcp.baselines.ring import RingPlanner
from dcp.baselines.te_a2a_p2p import TEA2AP2PPlanner
from dcp.baselines.torch_cp import TorchCPPlanner
from dcp.baselines.ulysses import UlyssesPlanner
from dcp.baselines.zigzag import ZigzagPlanner

BASELINES: dict[str, type] = {
    cls.name: cls for cls in (RingPlanner, ZigzagPlanner, TEA2AP2PPlanner, MegatronCPPlanner, MegatronDynCPPlanner,
                              LoongTrainPlanner, TorchCPPlanner, UlyssesPlanner, MagiPlanner, MagiDynamicPlanner)
}


def default_warm_planners() -> tuple:
    """One instance of the static baselines, per-sequence blocks: the default warm starts of dcp's search
    (``SearchConfig.warm_starts``). Magi's placements at 3, 4 and 6 chunks per rank (every rank then holds
    the mean tokens within a chunk, inside dcp's memory budget, where fixed chunk sizes may leave a rank up
    to a chunk over it), with inter-node deduplication, and at chunks of 1024 and 2048 tokens (often within
    the budget too, and then often the better placement); dcp estimates each at every overlap degree of
    ``VARIANT_DEGREES`` per direction (``MagiPlanner.schedule_variants``). And four points of Magi's dynamic
    solver: at 2048-token chunks and a FLOPs cap of 1.2x the mean (with the executor's host time charged,
    ``GPUProfile.host_*``, that coarser, less communicating placement, with fewer messages and kernel calls,
    wins H100 causal batches) and at 1024-token chunks and 1.05x (the finer, better balanced one, which
    Magi's tuned solver beat dcp with on short-sequence and shared-question batches), at its defaults
    (``total / 8P``-token chunks, 1.1x: finer still, which won H100 LongAlign x4 lambda batches) and at
    2048-token chunks and 1.05x (H100 causal batches). Magi's
    static dispatch at 2 chunks per rank without deduplication (the tuned point that beat dcp on H100
    LDC x4 shared-question batches). PyTorch CP's round-robin balancer at 256-token blocks (its tuned point at
    128-token blocks, ~4x the tiles, is past ``SearchConfig.warm_start_max_tiles`` on long sequences; from 256
    dcp beat it on H100 LongAlign x4 shared-question, the one batch within dcp's memory budget that a tuned
    baseline won). TE's a2a+p2p over the
    node and over a half, a quarter, ... of it, down to 2 GPUs (``TEA2AP2PPlanner.warm_points``). Megatron's static
    CP at every group size that fits dcp's memory budget (``MegatronCPPlanner.warm_points``): with the
    non-attention layers charged per token (``SearchConfig.token_time_s``) its exact token balance won an
    end-to-end cell (GPT-8B, LongAlign 64K causal) no other start reached. These
    won most often in the micro grid (``benchmarks/results/README.md``); more points cost planning time for
    little gain. And Ulysses where its head count allows (contiguous shards, every tile run by head block
    after an all-to-all: on the CPU profile, where a transfer's host cost is high, it beat every other
    start on 4-8 devices in the randomized sweep)."""
    magi = tuple(MagiPlanner(None, 4, True, k) for k in (3, 4, 6)) + tuple(MagiPlanner(c, 4) for c in (1024, 2048))
    return (RingPlanner(shards=False), ZigzagPlanner(shards=False), TEA2AP2PPlanner(shards=False),
            LoongTrainPlanner(shards=False), MegatronCPPlanner(), MegatronDynCPPlanner(), TorchCPPlanner(), MagiPlanner(),
            *magi, MagiDynamicPlanner(2048, 4, 1.2), MagiDynamicPlanner(1024, 4, 1.05), MagiDynamicPlanner(None, 4),
            MagiPlanner(None, 4, False, 2), MagiDynamicPlanner(2048, 4, 1.05), TorchCPPlanner("ptrr", 256),
            UlyssesPlanner())


__all__ = ["BASELINES", "default_warm_planners", "MagiPlanner", "MagiDynamicPlanner", "LoongTrainPlanner", "MegatronCPPlanner",
           "MegatronDynCPPlanner", "RingPlanner", "TEA2AP2PPlanner",
           "TorchCPPlanner", "UlyssesPlanner", "ZigzagPlanner"]
