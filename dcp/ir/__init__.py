"""The plan, dcp's intermediate representation: what every planner emits and every executor runs.

- ``plan``: ``Plan`` (batch, layout, tiles, placement, a forward and a backward program);
- ``program``: the columnar ``Program`` (tile stages, transfer rows, merge rows) and its per-device index;
- ``instructions``: the instruction view (``CommLaunch``, ``CommWait``, ``Compute``, ``Reduce``) for readers;
- ``validate`` (+ ``validate_arrays``, and ``validate_reference`` over the instruction view): every tile
  assigned once, every remote input sent before use, every partial output merged once;
- ``serialize``: ``Plan.to_bytes`` / ``Plan.from_bytes``; ``stats``: ``Plan.stats()``; ``memory``: resident
  tokens and transient buffer peaks per device; ``expand``: a grouped plan at piece granularity.
Nothing here plans: the modules stand on ``dcp.layout`` and the inputs only.
"""
from dcp.ir.instructions import CommLaunch, CommWait, Compute, DevicePlan, Reduce, Transfer, Unit
from dcp.ir.plan import Plan
from dcp.ir.program import Program
from dcp.ir.validate import validate

__all__ = ["Plan", "Program", "validate", "CommLaunch", "CommWait", "Compute", "DevicePlan", "Reduce", "Transfer",
           "Unit"]
