"""No-op kernels and transport, for running an executor on PyTorch's ``meta`` device.

On ``meta`` tensors (shapes and dtypes, no data) with these kernels and this ``Comm``, what a
``DeviceRunner`` step costs is its own Python and the dispatch of its views, copies and allocations:
the executor's host overhead (``dcp bench overhead``). Any data-dependent host operation (``.item()``,
``.tolist()`` of a tensor, a branch on a tensor's value) raises on ``meta`` tensors.

- ``NoopKernels``: ``forward`` / ``backward`` return uninitialized outputs of the right shapes and dtypes
  (as ``dcp.kernels`` defines them: o ``[Tq, Hq, D]`` in q's dtype, lse ``[Hq, Tq]`` in fp32, fp64 for
  fp64 inputs; gradients in ``out_dtype``); ``merge_into`` (log-sum-exp merge) and ``add_into`` (the
  executor's in-place sums of partial gradients) do nothing.
- ``NoopComm``: ``wait`` hands back the receive buffers ``launch`` was given, untouched.
"""
from __future__ import annotations

import torch


class NoopKernels:
    """Tile kernels, merges and sums that compute nothing (outputs of the right shapes, uninitialized)."""

    name = "noop"

    @staticmethod
    def _stat(dtype: torch.dtype) -> torch.dtype:
        return torch.float64 if dtype == torch.float64 else torch.float32

    def forward(self, q_thd, k_thd, v_thd, tiles, scale=None):
        tq, hq, _ = q_thd.shape
        o = torch.empty(q_thd.shape, dtype=q_thd.dtype, device=q_thd.device)
        return o, torch.empty((hq, tq), dtype=self._stat(q_thd.dtype), device=q_thd.device)

    def backward(self, do_thd, q_thd, k_thd, v_thd, lse_ht, delta_ht, tiles, scale=None, out_dtype=None):
        dt = out_dtype or q_thd.dtype
        return (torch.empty(q_thd.shape, dtype=dt, device=q_thd.device),
                torch.empty(k_thd.shape, dtype=dt, device=k_thd.device),
                torch.empty(v_thd.shape, dtype=dt, device=v_thd.device))

    @staticmethod
    def merge_into(o_acc, lse_acc, o_new, lse_new):
        return o_acc, lse_acc

    @staticmethod
    def add_into(accs, parts) -> None:
        return None

    def merge_partials(self, o_list, lse_list):
        return o_list[0], lse_list[0]


class NoopComm:
    """A ``Comm`` that moves nothing: ``wait`` hands back the receive buffers as they were."""

    def launch(self, round, sends, recvs):
        return [buf for _, buf in recvs]

    def wait(self, handle):
        return handle


def meta_home(plan, device: int, direction: str, dtype: torch.dtype, torch_device="meta") -> tuple:
    """Home tensors of ``device`` for ``direction`` (uninitialized, ``meta`` by default): forward
    ``(q, k, v)``, backward ``(q, k, v, do, lse, delta)`` with lse/delta in the stat dtype."""
    from dcp.execute.tables import plan_tables

    spec = plan.spec
    n = int(plan_tables(plan).n_local[device])
    dev = torch.device(torch_device)
    q = torch.empty((n, spec.num_heads, spec.head_dim), dtype=dtype, device=dev)
    k = torch.empty((n, spec.num_kv_heads, spec.head_dim), dtype=dtype, device=dev)
    v = torch.empty_like(k)
    if direction == "forward":
        return q, k, v
    stat = NoopKernels._stat(dtype)
    return (q, k, v, torch.empty_like(q), torch.empty((spec.num_heads, n), dtype=stat, device=dev),
            torch.empty((spec.num_heads, n), dtype=stat, device=dev))


__all__ = ["NoopKernels", "NoopComm", "meta_home"]
