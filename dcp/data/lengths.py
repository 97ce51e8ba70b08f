"""Sequence-length generators, paper-style batching and loaders for a user's own length files.

Synthetic stand-ins for the paper's datasets
--------------------------------------------
The DCP paper (SOSP'25) draws sequence lengths for its micro-benchmarks from two real datasets,
LongAlign-10k and Long-Data-Collections. Those datasets cannot be downloaded here, so the
distributions ``longalign`` and ``ldc`` below are **synthetic approximations**: mixtures of
log-normals whose parameters were chosen by hand to match the published description of each
dataset (LongAlign: long instruction data, mostly 8K-64K tokens; Long-Data-Collections: broad, many
short documents with a heavy tail of long ones). They are *not* fitted to the real data and every
number drawn from them is made up. Every parameter is listed in the class docstrings and returned by
``describe()``, so results produced with them can say exactly what was used.

``megatron_mock`` reproduces the length distribution of Megatron-Core's Dynamic CP mock benchmark
(log-normal, mean 1024, sigma 1.5, clipped to [128, 8192]); ``lognormal(...)`` builds any other
single log-normal.

Batching (``make_batches``) follows the paper: lengths are multiplied by a scale (the paper uses
0.5, 1, 2 and 4), sequences longer than the batch budget (131,072 tokens) are dropped, the rest are
packed greedily in arrival order into batches of at most ``tokens_per_batch`` tokens, and a batch is
kept only if it is at least ``min_fill`` (75%) full.

User length files (``load_length_batches``) may be ``.npy``, ``.txt`` or ``.json``; see that function.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np

from dcp.errors import InvalidBatchError

__all__ = [
    "LogNormalComponent",
    "LengthDistribution",
    "lognormal",
    "LONGALIGN",
    "LDC",
    "MEGATRON_MOCK",
    "DISTRIBUTIONS",
    "get_distribution",
    "BatchFormationError",
    "DEFAULT_TOKENS_PER_BATCH",
    "PAPER_SCALES",
    "make_batches",
    "load_length_batches",
    "parse_lengths_arg",
]

DEFAULT_TOKENS_PER_BATCH = 131072
"""The paper's batch budget in tokens."""

PAPER_SCALES = (0.5, 1.0, 2.0, 4.0)
"""The length scales used in the paper's micro-benchmarks."""

_INT64_MAX = np.iinfo(np.int64).max
_BOUNDS_MODES = ("clip", "resample")


class BatchFormationError(InvalidBatchError):
    """``make_batches`` could not form the requested number of batches (e.g. ``min_fill`` unreachable,
    or every sampled sequence is longer than the budget)."""


# --------------------------------------------------------------------------------------------------
# Distributions
# --------------------------------------------------------------------------------------------------

def _check_int(value, what: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise InvalidBatchError(f"{what} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _check_float(value, what: str, *, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidBatchError(f"{what} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or (positive and value <= 0):
        raise InvalidBatchError(f"{what} must be a finite{' positive' if positive else ''} number, "
                                f"got {value!r}")
    return value


@dataclass(frozen=True)
class LogNormalComponent:
    """One log-normal component of a length mixture.

    ``ln(length) ~ Normal(ln(median), sigma)`` restricted to ``[min_len, max_len]``; ``weight`` is the
    mixture weight (weights of a distribution are normalised to sum to 1).
    """

    weight: float
    median: float
    sigma: float
    min_len: int
    max_len: int

    def __post_init__(self):
        _check_float(self.weight, "component weight")
        _check_float(self.median, "component median")
        _check_float(self.sigma, "component sigma")
        _check_int(self.min_len, "component min_len")
        _check_int(self.max_len, "component max_len")
        if self.min_len > self.max_len:
            raise InvalidBatchError(f"component min_len {self.min_len} > max_len {self.max_len}")

    @property
    def mu(self) -> float:
        """Mean of ``ln(length)`` before clipping/resampling."""
        return math.log(self.median)

    @property
    def untruncated_mean(self) -> float:
        """Mean of the log-normal before clipping/resampling: ``exp(mu + sigma^2 / 2)``."""
        return math.exp(self.mu + self.sigma ** 2 / 2)

    def describe(self) -> dict:
        return {"weight": self.weight, "median": self.median, "mu": self.mu, "sigma": self.sigma,
                "min_len": self.min_len, "max_len": self.max_len}


@dataclass(frozen=True)
class LengthDistribution:
    """A mixture of log-normal sequence-length distributions.

    ``sample(n, rng)`` picks a component per draw by weight, draws ``exp(Normal(mu, sigma))``, rounds
    to the nearest integer and restricts it to the component's ``[min_len, max_len]`` either by
    ``bounds="clip"`` (out-of-range draws are clamped to the bound, as Megatron's mock benchmark does;
    this puts point masses on the bounds) or ``bounds="resample"`` (out-of-range draws are redrawn, i.e.
    a truncated log-normal with no point masses).

    ``synthetic`` marks distributions that stand in for a real dataset without being fitted to it;
    ``note`` says what they approximate and why the parameters were chosen.
    """

    name: str
    components: tuple[LogNormalComponent, ...]
    bounds: str = "resample"
    synthetic: bool = True
    note: str = ""

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise InvalidBatchError(f"distribution name must be a non-empty str, got {self.name!r}")
        if not isinstance(self.components, tuple) or not self.components or not all(
                isinstance(c, LogNormalComponent) for c in self.components):
            raise InvalidBatchError("components must be a non-empty tuple of LogNormalComponent")
        if self.bounds not in _BOUNDS_MODES:
            raise InvalidBatchError(f"bounds must be one of {_BOUNDS_MODES}, got {self.bounds!r}")

    @property
    def min_len(self) -> int:
        return min(c.min_len for c in self.components)

    @property
    def max_len(self) -> int:
        return max(c.max_len for c in self.components)

    @property
    def weights(self) -> np.ndarray:
        w = np.array([c.weight for c in self.components], dtype=np.float64)
        return w / w.sum()

    def sample(self, n: int, rng: np.random.Generator | int) -> np.ndarray:
        """``n`` lengths as an int64 array; deterministic given the state of ``rng``.

        ``rng`` is a ``numpy.random.Generator`` (an int is accepted as a seed for convenience).
        """
        n = _check_int(n, "n", minimum=0)
        rng = _as_generator(rng)
        out = np.empty(n, dtype=np.int64)
        if n == 0:
            return out
        if len(self.components) == 1:
            which = np.zeros(n, dtype=np.int64)
        else:
            which = rng.choice(len(self.components), size=n, p=self.weights)
        for k, comp in enumerate(self.components):
            idx = np.flatnonzero(which == k)
            if idx.size:
                out[idx] = self._sample_component(comp, idx.size, rng)
        return out

    def _sample_component(self, comp: LogNormalComponent, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.bounds == "clip":
            draws = np.rint(rng.lognormal(comp.mu, comp.sigma, size=n))
            return np.clip(draws, comp.min_len, comp.max_len).astype(np.int64)
        # resample: redraw out-of-range values until all are in range (bounded number of rounds)
        out = np.empty(n, dtype=np.int64)
        todo = np.arange(n)
        for _ in range(64):
            draws = np.rint(rng.lognormal(comp.mu, comp.sigma, size=todo.size))
            ok = (draws >= comp.min_len) & (draws <= comp.max_len)
            out[todo[ok]] = draws[ok].astype(np.int64)
            todo = todo[~ok]
            if todo.size == 0:
                return out
        # the in-range mass is tiny (badly chosen parameters): fall back to clipping the remainder
        draws = np.rint(rng.lognormal(comp.mu, comp.sigma, size=todo.size))
        out[todo] = np.clip(draws, comp.min_len, comp.max_len).astype(np.int64)
        return out

    def describe(self) -> dict:
        """JSON-able parameters: ``{"name", "synthetic", "bounds", "min_len", "max_len", "components",
        "note"}`` (for CSV headers, result metadata and the README)."""
        return {"name": self.name, "synthetic": self.synthetic, "bounds": self.bounds,
                "min_len": self.min_len, "max_len": self.max_len,
                "components": [c.describe() for c in self.components], "note": self.note}

    def summary(self) -> str:
        """One-line description, e.g. for a CSV comment header."""
        parts = [f"{c.weight:g}*LN(median={c.median:g},sigma={c.sigma:g})[{c.min_len},{c.max_len}]"
                 for c in self.components]
        tag = "synthetic " if self.synthetic else ""
        return f"{self.name}: {tag}{' + '.join(parts)} bounds={self.bounds}"


def _as_generator(rng) -> np.random.Generator:
    if isinstance(rng, np.random.Generator):
        return rng
    if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool):
        return np.random.default_rng(int(rng))
    raise InvalidBatchError(f"rng must be a numpy.random.Generator or an int seed, got {rng!r}")


def lognormal(mean: float, sigma: float, min: int, max: int, *, bounds: str = "clip",  # noqa: A002
              name: str = "lognormal", note: str = "") -> LengthDistribution:
    """A single log-normal whose *untruncated* mean is ``mean``: ``mu = ln(mean) - sigma^2 / 2``,
    restricted to ``[min, max]`` by ``bounds`` ("clip" by default, as Megatron does).

    The realised mean after clipping differs from ``mean`` (clipping the upper tail lowers it).
    """
    mean = _check_float(mean, "mean")
    sigma = _check_float(sigma, "sigma")
    median = mean * math.exp(-sigma ** 2 / 2)
    comp = LogNormalComponent(weight=1.0, median=median, sigma=sigma, min_len=min, max_len=max)
    how = "clipped" if bounds == "clip" else "truncated (resampled)"
    return LengthDistribution(
        name=name, components=(comp,), bounds=bounds, synthetic=True,
        note=note or (f"log-normal with untruncated mean {mean:g} (mu = ln(mean) - sigma^2/2 = "
                      f"{comp.mu:.4f}, median {median:.1f}), sigma {sigma:g}, {how} to [{min}, {max}]"))


LONGALIGN = LengthDistribution(
    name="longalign",
    components=(
        LogNormalComponent(weight=0.92, median=16384.0, sigma=0.5, min_len=8192, max_len=65536),
        LogNormalComponent(weight=0.08, median=5000.0, sigma=0.4, min_len=2048, max_len=8192),
    ),
    bounds="resample",
    synthetic=True,
    note=("SYNTHETIC approximation of LongAlign-10k (not fitted to the real data, which cannot be "
          "downloaded here). LongAlign-10k is long instruction data with lengths mostly 8K-64K tokens: "
          "92% of draws are a log-normal with median 16K and sigma 0.5 truncated to [8192, 65536] "
          "(about 9% of that component above 32K); 8% are shorter samples, median 5000, sigma 0.4, "
          "truncated to [2048, 8192], since the dataset also has some shorter ones. Overall: median "
          "~16K, mean ~18K, ~8% below 8K and ~8% above 32K."),
)

LDC = LengthDistribution(
    name="ldc",
    components=(
        LogNormalComponent(weight=0.80, median=1024.0, sigma=1.0, min_len=64, max_len=16384),
        LogNormalComponent(weight=0.15, median=8192.0, sigma=0.6, min_len=2048, max_len=32768),
        LogNormalComponent(weight=0.05, median=49152.0, sigma=0.5, min_len=16384, max_len=131072),
    ),
    bounds="resample",
    synthetic=True,
    note=("SYNTHETIC approximation of Long-Data-Collections (not fitted to the real data, which "
          "cannot be downloaded here). The collection is broad with many short documents and a heavy "
          "tail of long ones, so it is modelled as a 3-part mixture of truncated log-normals: 80% short "
          "documents (median 1024, sigma 1.0, [64, 16384]), 15% medium (median 8192, sigma 0.6, "
          "[2048, 32768]) and 5% long documents (median 48K, sigma 0.5, [16384, 131072]). Overall: "
          "median ~1.4K, mean ~5.4K, ~86% below 8K and ~4% above 32K."),
)

MEGATRON_MOCK = lognormal(
    1024, 1.5, 128, 8192, bounds="clip", name="megatron_mock",
    note=("Megatron-Core Dynamic CP mock benchmark lengths: log-normal with untruncated mean 1024 "
          "(mu = ln(1024) - 1.5^2/2 = 5.8065, median 332.4), sigma 1.5, clipped to [128, 8192] "
          "(about 26% of draws land on 128 and 1.7% on 8192); the clipped mean is ~909."),
)

DISTRIBUTIONS: dict[str, LengthDistribution] = {
    d.name: d for d in (LONGALIGN, LDC, MEGATRON_MOCK)
}
"""Named distributions: ``longalign``, ``ldc`` (synthetic approximations) and ``megatron_mock``."""


def get_distribution(name: Union[str, LengthDistribution]) -> LengthDistribution:
    """The registered distribution called ``name`` (a ``LengthDistribution`` is returned unchanged)."""
    if isinstance(name, LengthDistribution):
        return name
    if isinstance(name, str) and name in DISTRIBUTIONS:
        return DISTRIBUTIONS[name]
    raise InvalidBatchError(f"unknown length distribution {name!r}; valid names: "
                            f"{', '.join(sorted(DISTRIBUTIONS))}")


# --------------------------------------------------------------------------------------------------
# Batching
# --------------------------------------------------------------------------------------------------

_CHUNK = 4096  # lengths are sampled in chunks of this size; fixed so a seed always gives the same stream


def make_batches(dist_or_name: Union[str, LengthDistribution], scale: float = 1.0,
                 tokens_per_batch: int = DEFAULT_TOKENS_PER_BATCH, num_batches: int = 1,
                 seed: int = 0, min_fill: float = 0.75, max_seqlen: int | None = None,
                 max_samples: int | None = None) -> list[np.ndarray]:
    """Exactly ``num_batches`` batches of sequence lengths, formed as in the paper.

    Lengths are drawn from the distribution as a stream (``numpy.random.default_rng(seed)``, chunks of
    4096 draws, so the result depends only on the arguments), multiplied by ``scale`` and rounded
    (at least 1). A sequence longer than ``tokens_per_batch`` (or than ``max_seqlen`` when given) is
    dropped. The rest are packed greedily in arrival order: a sequence joins the open batch if it
    fits, otherwise the open batch is closed, kept only if its token count is at least
    ``min_fill * tokens_per_batch``, and a new batch starts with that sequence.

    Returns a list of int64 arrays, lengths in arrival order, each summing to at most
    ``tokens_per_batch`` and at least ``ceil(min_fill * tokens_per_batch)``.

    Raises ``InvalidBatchError`` for bad arguments and ``BatchFormationError`` (a subclass) when
    ``max_samples`` draws (default ``max(1_000_000, num_batches * tokens_per_batch // 16)``) do not
    produce ``num_batches`` kept batches.
    """
    dist = get_distribution(dist_or_name)
    scale = _check_float(scale, "scale")
    tokens_per_batch = _check_int(tokens_per_batch, "tokens_per_batch")
    num_batches = _check_int(num_batches, "num_batches", minimum=0)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise InvalidBatchError(f"seed must be a non-negative int, got {seed!r}")
    min_fill = _check_float(min_fill, "min_fill", positive=False)
    if not 0.0 <= min_fill <= 1.0:
        raise InvalidBatchError(f"min_fill must be in [0, 1], got {min_fill}")
    cap = tokens_per_batch
    if max_seqlen is not None:
        cap = min(cap, _check_int(max_seqlen, "max_seqlen"))
    if max_samples is None:
        max_samples = max(1_000_000, num_batches * tokens_per_batch // 16)
    max_samples = _check_int(max_samples, "max_samples")

    min_tokens = math.ceil(min_fill * tokens_per_batch - 1e-9)
    rng = np.random.default_rng(int(seed))
    kept: list[np.ndarray] = []
    current: list[int] = []
    used = 0
    drawn = 0
    accepted = 0
    while len(kept) < num_batches:
        if drawn >= max_samples:
            raise BatchFormationError(
                f"could not form {num_batches} batches of {tokens_per_batch} tokens at least "
                f"{min_fill:.0%} full from {dist.name!r} at scale {scale:g} (max_seqlen={max_seqlen}) "
                f"after {drawn} samples: {len(kept)} kept, {accepted} sequences within the length cap "
                f"{cap}; lower min_fill, change the scale or raise max_samples")
        raw = dist.sample(_CHUNK, rng)
        drawn += _CHUNK
        scaled = np.maximum(np.rint(raw * scale), 1).astype(np.int64)
        scaled = scaled[scaled <= cap]
        accepted += scaled.size
        for length in scaled.tolist():
            if used + length <= tokens_per_batch:
                current.append(length)
                used += length
                continue
            if used >= min_tokens:
                kept.append(np.array(current, dtype=np.int64))
                if len(kept) == num_batches:
                    break
            current = [length]
            used = length
    return kept


# --------------------------------------------------------------------------------------------------
# User length files and CLI flags
# --------------------------------------------------------------------------------------------------

_SPLIT = re.compile(r"[,\s]+")
_TXT_BATCH_SEPARATOR = "---"


def _check_length(value, where: str) -> int:
    """A positive int64-representable length (bools and floats are refused)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InvalidBatchError(f"{where}: {value!r} is not an integer length")
    if value <= 0:
        raise InvalidBatchError(f"{where}: length {value} is not positive")
    if value > _INT64_MAX:
        raise InvalidBatchError(f"{where}: length {value} does not fit in int64")
    return int(value)


def _parse_token(token: str, where: str) -> int:
    try:
        value = int(token)
    except ValueError:
        raise InvalidBatchError(f"{where}: {token!r} is not an integer length") from None
    return _check_length(value, where)


def parse_lengths_arg(text: str) -> np.ndarray:
    """Lengths from a CLI flag such as ``"8192,4096,1000"`` (or separated by whitespace only).

    With commas, every comma separates exactly two entries: an empty entry (``"4096,,5"``, a trailing
    comma) is an error, not skipped. Returns an int64 array; raises ``InvalidBatchError`` naming the
    offending entry and its position.
    """
    if not isinstance(text, str):
        raise InvalidBatchError(f"lengths must be given as a string, got {text!r}")
    if not text.strip(" ,\t\n"):
        raise InvalidBatchError(f"no sequence lengths in {text!r}")
    tokens = [t.strip() for t in text.split(",")] if "," in text else text.split()
    for i, t in enumerate(tokens):
        if not t:
            raise InvalidBatchError(f"lengths {text!r}, entry {i} is empty (two commas in a row, or a comma at "
                                    f"an end)")
    return np.array([_parse_token(t, f"lengths {text!r}, entry {i}") for i, t in enumerate(tokens)],
                    dtype=np.int64)


def load_length_batches(path: Union[str, os.PathLike]) -> list[np.ndarray]:
    """Batches of sequence lengths from a user's file; a flat list of lengths is one batch.

    Formats (chosen by extension, case-insensitive):

    * ``.npy`` -- a 1-D integer array (one batch) or a 2-D integer array (one batch per row).
      Non-integer dtypes and pickled object arrays are refused.
    * ``.txt`` -- integers separated by commas, spaces or newlines; ``#`` starts a comment that runs to
      the end of the line. A line containing only ``---`` starts a new batch.
    * ``.json`` -- a list of ints (one batch), a list of lists of ints (several batches), or an object
      ``{"lengths": ...}`` / ``{"batches": ...}`` holding either of those. JSON floats (even ``8192.0``)
      and booleans are refused.

    Every length must be a positive integer and every batch non-empty. Any problem (missing file,
    unknown extension, unparsable content, bad or empty entries) raises ``InvalidBatchError`` naming
    the path and the offending entry's position.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise InvalidBatchError(f"{path}: length file not found")
    ext = os.path.splitext(path)[1].lower()
    if ext == ".npy":
        batches = _load_npy(path)
    elif ext == ".txt":
        batches = _load_txt(path)
    elif ext == ".json":
        batches = _load_json(path)
    else:
        raise InvalidBatchError(f"{path}: unknown length-file extension {ext or '(none)'!r}; "
                                f"use .npy, .txt or .json")
    if not batches:
        raise InvalidBatchError(f"{path}: no sequence lengths in file")
    for b, batch in enumerate(batches):
        if batch.size == 0:
            raise InvalidBatchError(f"{path}: batch {b} is empty")
    return batches


def _load_npy(path: str) -> list[np.ndarray]:
    try:
        arr = np.load(path, allow_pickle=False)
    except Exception as exc:  # corrupt file, object array (needs pickle), npz under .npy name, ...
        raise InvalidBatchError(f"{path}: cannot read as a .npy integer array ({exc})") from None
    if not isinstance(arr, np.ndarray):
        raise InvalidBatchError(f"{path}: expected a single .npy array")
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise InvalidBatchError(f"{path}: array dtype {arr.dtype} is not an integer type")
    if arr.ndim == 1:
        rows = [arr]
    elif arr.ndim == 2:
        rows = list(arr)
    else:
        raise InvalidBatchError(f"{path}: expected a 1-D (one batch) or 2-D (batch per row) array, "
                                f"got shape {arr.shape}")
    batches = []
    for b, row in enumerate(rows):
        bad = np.flatnonzero(row <= 0)
        if bad.size:
            i = int(bad[0])
            where = f"entry {i}" if arr.ndim == 1 else f"batch {b}, entry {i}"
            raise InvalidBatchError(f"{path}: {where}: length {row[i]} is not positive")
        if arr.dtype == np.uint64 and row.size and int(row.max()) > _INT64_MAX:
            i = int(np.argmax(row))
            raise InvalidBatchError(f"{path}: batch {b}, entry {i}: length {row[i]} does not fit in int64")
        batches.append(row.astype(np.int64))
    return batches


def _load_txt(path: str) -> list[np.ndarray]:
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidBatchError(f"{path}: cannot read text length file ({exc})") from None
    batches: list[list[int]] = [[]]
    for lineno, line in enumerate(lines, start=1):
        content = line.split("#", 1)[0].strip()
        if content == _TXT_BATCH_SEPARATOR:
            if not batches[-1]:
                raise InvalidBatchError(f"{path}: line {lineno}: batch separator '---' closes an "
                                        f"empty batch")
            batches.append([])
            continue
        for col, token in enumerate(t for t in _SPLIT.split(content) if t):
            batches[-1].append(_parse_token(token, f"{path}: line {lineno}, entry {col}"))
    if len(batches) > 1 and not batches[-1]:
        raise InvalidBatchError(f"{path}: the last batch (after the final '---') is empty")
    if len(batches) == 1 and not batches[0]:
        return []
    return [np.array(b, dtype=np.int64) for b in batches]


def _load_json(path: str) -> list[np.ndarray]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidBatchError(f"{path}: cannot parse JSON length file ({exc})") from None
    if isinstance(data, dict):
        keys = [k for k in ("lengths", "batches") if k in data]
        if len(keys) != 1:
            raise InvalidBatchError(f"{path}: a JSON object must have exactly one of the keys "
                                    f"'lengths' or 'batches', got keys {sorted(data)}")
        data = data[keys[0]]
    if not isinstance(data, list):
        raise InvalidBatchError(f"{path}: expected a JSON list of lengths or of batches, "
                                f"got {type(data).__name__}")
    if not data:
        return []
    if all(isinstance(x, list) for x in data):
        return [_json_batch(batch, f"{path}: batch {b}") for b, batch in enumerate(data)]
    if any(isinstance(x, list) for x in data):
        i = next(i for i, x in enumerate(data) if not isinstance(x, list))
        raise InvalidBatchError(f"{path}: entry {i}: {data[i]!r} mixes a length with lists of lengths; "
                                f"use a flat list (one batch) or a list of lists (batches)")
    return [_json_batch(data, f"{path}: batch 0")]


def _json_batch(values: Sequence, where: str) -> np.ndarray:
    return np.array([_check_length(v, f"{where}, entry {i}") for i, v in enumerate(values)],
                    dtype=np.int64)
