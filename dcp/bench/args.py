"""Command-line pieces shared by ``dcp plan``, ``dcp bench`` and the training scripts in ``experiments/``.

One syntax for masks everywhere: ``--mask NAME`` plus repeated ``--mask-param KEY=VALUE`` (parameters
belong to the ``--mask`` before them; where a command takes several masks, ``--mask`` repeats). Also the
default partitioner's name (read from ``PlannerConfig``, so help texts never drift from the code), cost
profiles by name or JSON path, the ``--nproc`` sanity check and plural nouns for printed counts.

This module imports nothing heavy at import time: the training scripts import it before torch starts.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import warnings
from typing import Iterable, Mapping, Sequence

from dcp.errors import InvalidConfigError

MASK_NAMES_HELP = ("causal, full, sliding_window, lambda, shared_question, causal_blockwise, modality, prefix_lm, "
                   "document")


def plural(n: int, noun: str, plural_form: str | None = None) -> str:
    """``"1 sequence"``, ``"3 sequences"`` (thousands separated)."""
    return f"{n:,} {noun if n == 1 else plural_form or noun + 's'}"


# ------------------------------------------------------------------------------------------ masks
@dataclasses.dataclass(frozen=True)
class MaskArg:
    """A mask as a command line names it: a family (``dcp.masks.MASKS``) and its parameters as strings."""

    name: str
    params: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, name: str, **params) -> "MaskArg":
        """``MaskArg.of("lambda", sink=4, window=64)``."""
        return cls(name, tuple((k, str(v)) for k, v in params.items()))

    @classmethod
    def parse(cls, text: "str | MaskArg") -> "MaskArg":
        """A bare family name, or the deprecated ``"name:key=value,..."`` (train_hf.py's old syntax)."""
        if isinstance(text, MaskArg):
            return text
        name, sep, rest = text.partition(":")
        if not sep:
            return cls(name.strip())
        _deprecated(f"--mask {text!r}: 'NAME:key=value,...' is deprecated and goes in the next release; write "
                    f"--mask {name} " + " ".join(f"--mask-param {x}" for x in rest.split(",") if x))
        return cls(name.strip(), tuple(parse_mask_params(filter(None, rest.split(",")))))

    def build(self, defaults: Mapping[str, Mapping[str, object]] | None = None):
        """The ``dcp.masks`` mask; ``defaults[name]`` fills parameters not given (e.g. small windows)."""
        from dcp.masks import from_cli

        params = {**(defaults or {}).get(self.name, {}), **dict(self.params)}
        return from_cli(self.name, **params)

    def __str__(self) -> str:
        return " ".join([f"--mask {self.name}", *(f"--mask-param {k}={v}" for k, v in self.params)])


def _deprecated(message: str) -> None:
    # FutureWarning, not DeprecationWarning: Python shows it to the users of a script by default
    warnings.warn(message, FutureWarning, stacklevel=3)


def parse_mask_params(items: Iterable[str], flag: str = "--mask-param") -> list[tuple[str, str]]:
    """``["window=4096", "sink=64"]`` -> ``[("window", "4096"), ("sink", "64")]`` (dashes in keys become
    underscores: ``num-prev`` is ``num_prev``)."""
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise InvalidConfigError(f"{flag} takes KEY=VALUE, got {item!r}")
        out.append((key.strip().replace("-", "_"), value.strip()))
    return out


class _MaskAction(argparse.Action):
    """``--mask NAME``: starts a new mask; ``--mask-param`` after it adds to it."""

    def __call__(self, parser, namespace, values, option_string=None):
        masks = list(getattr(namespace, "mask_list", None) or [])
        pending = getattr(namespace, "mask_pending", None) or []
        if not values.partition(":")[0].strip():
            parser.error(f"--mask needs a family name, got {values!r}")
        masks.append([values, pending])  # parameters given before any --mask belong to the first one
        namespace.mask_list, namespace.mask_pending = masks, []
        setattr(namespace, self.dest, values)


class _MaskParamAction(argparse.Action):
    """``--mask-param KEY=VALUE`` (repeatable): a parameter of the ``--mask`` before it."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string and option_string != "--mask-param":
            _deprecated(f"{option_string} is deprecated and goes in the next release; use --mask-param {values}")
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest, None) or []), values])
        masks = getattr(namespace, "mask_list", None)
        if masks:
            masks[-1][1].append(values)
        else:
            namespace.mask_pending = [*(getattr(namespace, "mask_pending", None) or []), values]


def add_mask_args(p, default: str = "causal", several: bool = False, old_param_flags: Sequence[str] = ()) -> None:
    """``--mask NAME`` (repeatable when ``several``: samples or sequences take the masks in turn) and
    ``--mask-param KEY=VALUE`` (repeatable). ``old_param_flags``: deprecated spellings of --mask-param."""
    p.add_argument("--mask", default=default, action=_MaskAction, metavar="NAME",
                   help=f"mask family ({MASK_NAMES_HELP})" + ("; repeat it to give sequences different masks, "
                                                              "in turn" if several else ""))
    p.add_argument("--mask-param", action=_MaskParamAction, metavar="KEY=VALUE", default=None,
                   help="a parameter of the --mask before it, e.g. --mask lambda --mask-param sink=64 --mask-param "
                        "window=4096 (repeat for each parameter)")
    if old_param_flags:  # still accepted for one release, with a warning; not advertised
        p.add_argument(*old_param_flags, action=_MaskParamAction, dest="mask_param", help=argparse.SUPPRESS)


def masks_from_args(args, several: bool = False) -> list[MaskArg]:
    """The ``MaskArg`` of each ``--mask`` given (the default mask when none was), parameters parsed.
    Without ``several``, a second ``--mask`` is an error (a flag that would silently win is a trap)."""
    given = getattr(args, "mask_list", None) or []
    pending = getattr(args, "mask_pending", None) or []
    if not given:
        given = [[args.mask, []]]
    if pending:  # --mask-param with no --mask at all: the default mask's
        given[0][1][:0] = pending
    if len(given) > 1 and not several:
        raise InvalidConfigError(f"--mask given {len(given)} times ({', '.join(g[0] for g in given)}); this "
                                 f"command takes one mask")
    out = []
    for name, params in given:
        base = MaskArg.parse(name)  # the deprecated "name:k=v,..." still parses, with a warning
        out.append(MaskArg(base.name, base.params + tuple(parse_mask_params(params))))
    return out


# ------------------------------------------------------------------------------------------ defaults
def default_partitioner_name() -> str:
    """The ``--partitioner`` name of ``PlannerConfig``'s default partitioner (``dcp.partition``)."""
    from dcp.config import PlannerConfig
    from dcp.partition import PARTITIONER_NAMES, named_partitioner

    default = PlannerConfig().partitioner
    return next((n for n in PARTITIONER_NAMES if named_partitioner(n) == default), repr(default))


def partitioner_help() -> str:
    """What each ``--partitioner`` name is, the default named from the code."""
    from dcp.config import PlannerConfig

    default = PlannerConfig().partitioner
    return (f"hypergraph partitioner of dcp; default {default_partitioner_name()} = Mt-KaHyPar's "
            f"{getattr(default, 'preset', '')} preset (PlannerConfig's default: the same plan in every process). "
            "quality: deterministic_quality; deterministic: Mt-KaHyPar's deterministic preset (~10%% faster, a "
            "few %% more bytes); fast (alias mtkahypar): Mt-KaHyPar's default preset, varies run to run; kahypar; "
            "greedy (no dependency)")


# ------------------------------------------------------------------------------------------ profiles
def check_profile(name_or_path: str) -> str:
    """Refuse an unknown profile before any work, naming both ways to give one: a bundled name, or a
    path to a JSON file (``dcp bench calibrate`` writes one)."""
    from dcp.cost.model import available_profiles

    if name_or_path.endswith(".json") or os.sep in name_or_path:
        path = os.path.expanduser(name_or_path)
        if not os.path.isfile(path):
            raise InvalidConfigError(f"--profile {name_or_path!r}: no such file (a profile is a bundled name, "
                                     f"{', '.join(available_profiles())}, or a path to a .json file)")
        if not path.endswith(".json"):
            raise InvalidConfigError(f"--profile {name_or_path!r}: a profile file must end in .json")
        return path
    if name_or_path.lower() not in available_profiles():
        raise InvalidConfigError(f"--profile {name_or_path!r}: unknown; bundled: {', '.join(available_profiles())}, "
                                 f"or give a path to a .json file (dcp bench calibrate writes one)")
    return name_or_path


PROFILE_HELP = "cost-model profile: a bundled name ({names}) or a path to a .json file (dcp bench calibrate writes one)"


def profile_help() -> str:
    from dcp.cost.model import available_profiles

    return PROFILE_HELP.format(names=", ".join(available_profiles()))


# ------------------------------------------------------------------------------------------ processes
def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, else ``os.cpu_count()``)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def nproc_warning(nproc: int, threads: int | None = None) -> str | None:
    """A warning when ``nproc`` processes (x ``threads`` each) exceed the cores: their timings would
    measure time slicing, not the plans."""
    cores = usable_cores()
    busy = nproc * (threads or 1)
    if busy <= cores:
        return None
    return (f"warning: --nproc {nproc}" + (f" x --threads {threads}" if threads and threads > 1 else "") +
            f" = {busy} busy threads on {plural(cores, 'core')}: the processes take turns on the cores, so the "
            f"measured times are not the plans' (use --nproc <= {cores})")


__all__ = ["MaskArg", "add_mask_args", "masks_from_args", "parse_mask_params", "plural", "default_partitioner_name",
           "partitioner_help", "check_profile", "profile_help", "usable_cores", "nproc_warning"]
