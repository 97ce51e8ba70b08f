"""A plan for a model whose layers differ: one placement of the tokens, one ``Plan`` per layer kind.

Activations live on the tokens' homes, so every layer of a model must find each token on the same device;
what a layer computes and moves may differ with its kind (a sliding-window layer needs only its neighbours'
keys). A ``LayeredPlan`` holds one ordinary, validated ``Plan`` per kind of a layered ``BatchSpec``
(``BatchSpec(..., masks={"full": ..., "sliding": ...}, layers={...})``): every kind's plan puts every token on
the same home; its blocks may be cut finer (a windowed kind moves only the keys its neighbours need), and
it has its own tiles (exactly those its masks give), their devices and both programs. ``kind(name)`` is the plan a layer of that kind runs; ``dcp.attention(..., kind=name)`` and
``DCPAttention(...)(q, k, v, plan, kind=name)`` pick it.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

import numpy as np

from dcp.errors import InvalidPlanError, SerializationError
from dcp.ir.plan import Plan
from dcp.spec import BatchSpec

_MAGIC = b"DCPLAYR1"


@dataclass(frozen=True, eq=False)
class LayeredPlan:
    """One plan per layer kind over one placement.

    ``spec``: the layered batch (``spec.kinds``, ``spec.layers``); ``plans``: the kinds' plans in
    ``spec.kinds`` order, each on ``spec.for_kind(kind)``. Construction checks that they agree (same cluster,
    every token's home; ``InvalidPlanError`` otherwise). The token-side questions (``token_device``,
    ``local_token_index``, ...) are answered once for all kinds; ``layout``/``home`` are the first kind's.
    """

    spec: BatchSpec
    plans: tuple[Plan, ...]
    planner: str = "dcp"
    planning_time_s: float = 0.0
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """``InvalidPlanError`` unless the kinds' plans agree (``check_layered``)."""
        check_layered(self.spec, self.plans)

    @property
    def kinds(self) -> tuple[str, ...]:
        return self.spec.kinds

    @property
    def layers(self) -> tuple[int, ...]:
        return self.spec.layers

    def kind(self, name: str) -> Plan:
        """The plan of layer kind ``name`` (``InvalidPlanError`` naming the kinds for another name)."""
        if name not in self.spec.kinds:
            raise InvalidPlanError(f"no layer kind {name!r} in this plan (kinds: {list(self.spec.kinds)})")
        return self.plans[self.spec.kinds.index(name)]

    # token-side views: identical for every kind
    @property
    def cluster(self):
        return self.plans[0].cluster

    @property
    def n_devices(self) -> int:
        return self.plans[0].n_devices

    @property
    def layout(self):
        return self.plans[0].layout

    @property
    def home(self) -> np.ndarray:
        return self.plans[0].home

    def token_device(self) -> np.ndarray:
        return self.plans[0].token_device()

    def local_blocks(self, device: int) -> np.ndarray:
        return self.plans[0].local_blocks(device)

    def local_token_index(self, device: int) -> np.ndarray:
        return self.plans[0].local_token_index(device)

    def stats(self) -> dict:
        """``{kind: PlanStats}`` (``Plan.stats`` of every kind's plan)."""
        return {k: p.stats() for k, p in zip(self.spec.kinds, self.plans)}

    def to_bytes(self, compress: bool | None = None) -> bytes:
        """The kinds, their layer counts and every kind's ``Plan.to_bytes``, length-prefixed."""
        head = json.dumps({"kinds": list(self.spec.kinds), "layers": list(self.spec.layers),
                           "planner": self.planner}, sort_keys=True).encode()
        parts = [head] + [p.to_bytes(compress) for p in self.plans]
        return _MAGIC + b"".join(struct.pack("<Q", len(b)) + b for b in parts)

    @staticmethod
    def from_bytes(data: bytes) -> "LayeredPlan":
        """The plan ``to_bytes`` wrote (``SerializationError`` for anything else)."""
        if not isinstance(data, (bytes, bytearray, memoryview)) or bytes(data[:8]) != _MAGIC:
            raise SerializationError("not a serialized dcp LayeredPlan (bad magic)")
        data, pos, parts = bytes(data), 8, []
        while pos < len(data):
            if pos + 8 > len(data):
                raise SerializationError("truncated LayeredPlan")
            (n,) = struct.unpack_from("<Q", data, pos)
            if pos + 8 + n > len(data):
                raise SerializationError("truncated LayeredPlan")
            parts.append(data[pos + 8:pos + 8 + n])
            pos += 8 + n
        try:
            head = json.loads(parts[0])
            kinds, layers = list(head["kinds"]), list(head["layers"])
        except (IndexError, ValueError, KeyError, TypeError) as err:
            raise SerializationError(f"bad LayeredPlan header: {err}") from None
        if len(parts) != len(kinds) + 1 or len(layers) != len(kinds):
            raise SerializationError(f"LayeredPlan header names {len(kinds)} kinds, {len(parts) - 1} plans follow")
        plans = tuple(Plan.from_bytes(b) for b in parts[1:])
        first = plans[0].spec
        spec = BatchSpec(first.seqlens, {k: p.spec.masks for k, p in zip(kinds, plans)}, first.num_heads,
                         first.num_kv_heads, first.head_dim, first.dtype, layers=dict(zip(kinds, layers)))
        return LayeredPlan(spec, plans, head.get("planner", "dcp"))

    def __repr__(self) -> str:
        kinds = ", ".join(f"{k} x{n}: {p.tiles.n_tiles} tiles" for k, n, p in
                          zip(self.spec.kinds, self.spec.layers, self.plans))
        return (f"LayeredPlan(planner={self.planner!r}, devices={self.n_devices}, seqs={self.spec.num_seqs}, "
                f"tokens={self.spec.total_tokens}, kinds=[{kinds}])")


def check_layered(spec: BatchSpec, plans) -> None:
    """``InvalidPlanError`` unless ``plans`` are one ``Plan`` per kind of ``spec``, in order, each on that kind's
    masks, all on one cluster with every token on the same home (their blocks may differ)."""
    if not isinstance(spec, BatchSpec) or not spec.kinds:
        raise InvalidPlanError("a LayeredPlan needs a layered BatchSpec (masks given as a dict of layer kinds)")
    plans = tuple(plans)
    if len(plans) != len(spec.kinds) or not all(isinstance(p, Plan) for p in plans):
        raise InvalidPlanError(f"a LayeredPlan needs one Plan per layer kind ({len(spec.kinds)}), got "
                               f"{[type(p).__name__ for p in plans]}")
    first = plans[0]
    for name, p in zip(spec.kinds, plans):
        if p.spec != spec.for_kind(name):
            raise InvalidPlanError(f"layer kind {name!r}: its plan is for another batch or other masks")
        if p.cluster != first.cluster:
            raise InvalidPlanError(f"layer kind {name!r}: its plan is for another cluster")
        if not np.array_equal(p.token_device(), first.token_device()):
            raise InvalidPlanError(f"layer kind {name!r}: its tokens' homes differ from kind {spec.kinds[0]!r}'s "
                                   "(every layer must find each token on the same device)")


def plan_from_bytes(data: bytes) -> "Plan | LayeredPlan":
    """The ``Plan`` or ``LayeredPlan`` whose ``to_bytes`` wrote ``data`` (``SerializationError`` otherwise)."""
    if isinstance(data, (bytes, bytearray, memoryview)) and bytes(data[:8]) == _MAGIC:
        return LayeredPlan.from_bytes(data)
    return Plan.from_bytes(data)


def select_kind(plan, kind: str | None) -> Plan:
    """The ``Plan`` a layer of ``kind`` runs: ``plan`` itself for a ``Plan`` (``kind`` None, or the plan is
    not layered: ``InvalidPlanError`` for a kind it does not have), ``plan.kind(kind)`` for a ``LayeredPlan``
    (``kind`` may be omitted only when it has one kind)."""
    if isinstance(plan, LayeredPlan):
        if kind is None:
            if len(plan.kinds) == 1:
                return plan.plans[0]
            raise InvalidPlanError(f"this plan has layer kinds {list(plan.kinds)}: say which one the layer is "
                                   "(kind=...)")
        return plan.kind(kind)
    if kind is not None and isinstance(plan, Plan):
        raise InvalidPlanError(f"kind={kind!r} given, but the plan has one layer kind (plan a batch with "
                               "masks={kind: mask, ...} for layer kinds)")
    return plan
