"""Executors: run a plan's per-device programs, forward and backward.

- ``ReferenceExecutor``: all devices in one process (in-memory transfers), for testing and debugging;
- ``attention(q_local, k_local, v_local, plan, group=None, *, kind=None, sinks=None)``: differentiable
  distributed attention over ``torch.distributed`` (gloo on CPU, NCCL on GPU), one process per device
  (``DistributedExecutor``); ``plan`` a ``Plan`` or a ``LayeredPlan`` with the layer's ``kind``; ``sinks [Hq]``
  attention-sink logits, applied to the final (o, lse) at home (``dcp.execute.autograd``);
- ``dispatch``/``undispatch``: scatter a packed batch to the devices' local layouts and gather it back;
- ``reference_attention``: dense masked attention of the whole packed batch (the ground truth).

The per-device interpreter both executors share is ``dcp.execute.local``; it runs the steps that
``dcp.execute.compile`` derives once per plan (every view, copy and merge resolved), from the per-plan
tables of ``dcp.execute.tables`` (op streams, buffer layouts, message layouts, reusable buffers; cached
per plan object). ``dcp.execute.noop``: no-op kernels and transport for running it on ``meta`` tensors.
"""
from dcp.execute.autograd import DCPAttentionFunction, attention
from dcp.execute.dispatch import dispatch, undispatch
from dcp.execute.distributed import DistributedExecutor
from dcp.execute.oracle import reference_attention
from dcp.execute.reference import ReferenceExecutor

__all__ = ["ReferenceExecutor", "DistributedExecutor", "DCPAttentionFunction", "attention", "dispatch",
           "undispatch", "reference_attention"]
