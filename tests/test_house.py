"""The package's shape: the public API of every public module, and imports that point one way.

Every name ``dcp``, ``dcp.masks``, ``dcp.baselines``, ``dcp.execute``, ``dcp.integration``, ``dcp.sim`` and
``dcp.cost`` exported before the package was laid out by pipeline stage still imports from there. The
import graph is read from the source (every ``import`` statement, also inside functions; not those under
``if TYPE_CHECKING:``): no module imports itself through others, and the folders (and top-level
modules) form a DAG, so each stage stands only on the stages below it.
"""
import ast
import importlib
from pathlib import Path

import networkx as nx
import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dcp"

PUBLIC = {
    "dcp": ["BatchSpec", "Cluster", "DCPAttention", "DCPLoader", "DCPPlanner", "DcpError", "ExecutionError",
            "GreedyPartitioner", "InvalidBatchError", "InvalidClusterError", "InvalidConfigError", "InvalidMaskError",
            "KaHyParPartitioner", "MemoryBudgetError", "MtKaHyParPartitioner", "PartitionerError", "Plan",
            "PlanMismatchError", "PlanValidationError", "Planner", "PlannerConfig", "ReferenceExecutor", "SampleRejectedError",
            "SearchConfig", "SerializationError", "TooFewBlocksError", "attention", "broadcast_plan", "dispatch", "plan",
            "reference_attention", "undispatch", "validate"],
    "dcp.baselines": ["BASELINES", "LoongTrainPlanner", "MegatronDynCPPlanner", "RingPlanner", "TEA2AP2PPlanner",
                      "ZigzagPlanner"],
    "dcp.cost": ["CostModel", "GPUProfile", "available_profiles", "load_profile"],
    "dcp.execute": ["DCPAttentionFunction", "DistributedExecutor", "ReferenceExecutor", "attention", "dispatch",
                    "reference_attention", "undispatch"],
    "dcp.integration": ["CachedPlan", "DCPAttention", "DCPBatch", "DCPLoader", "IGNORE_INDEX", "InlinePlanner",
                        "PlanCache", "PlanMismatchError", "PlanWorker", "PlannerWorkerDiedError", "PlanningError",
                        "PlanningTimeoutError", "Sample", "SampleRejectedError", "SharedPlan", "WorkerConfig",
                        "batch_digest", "make_planner", "pack_positions_labels", "plan_description", "plan_key",
                        "share_plan", "sum_gradients"],
    "dcp.masks": ["CausalBlockwiseMask", "CausalMask", "DocumentMask", "FullMask", "LambdaMask", "MASKS", "Mask",
                  "MaskModMask", "ModalityMask", "PrefixLMMask", "RangesMask", "SharedQuestionMask",
                  "SlidingWindowMask", "check_seqlen", "dense_to_ranges", "draw_ranges", "from_cli",
                  "from_description", "from_mask_mod", "pack_two_ranges", "ranges_to_dense", "validate_ranges"],
    "dcp.sim": ["FluidNetwork", "SimEvent", "SimResult", "ideal_time_s", "iteration_time_s", "max_min_rates",
                "simulate", "simulate_both", "tile_times", "to_chrome_trace", "trace_events"],
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_public_api_imports_from_where_it_did(module):
    mod = importlib.import_module(module)
    missing = [name for name in PUBLIC[module] if not hasattr(mod, name)]
    assert not missing, f"{module} no longer exports {missing}"
    exported = getattr(mod, "__all__", None)
    if exported is not None:  # `from module import *` keeps giving them
        assert not set(PUBLIC[module]) - set(exported) - {"annotations"}, set(PUBLIC[module]) - set(exported)


def test_subpackages_reachable_from_the_top():
    import dcp

    for name in ("masks", "baselines", "sim", "cost", "execute", "integration", "ir", "layout", "schedule"):
        assert getattr(dcp, name).__name__ == f"dcp.{name}"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph() -> nx.DiGraph:
    """Module → module it imports (runtime imports only: those under ``if TYPE_CHECKING:`` are skipped)."""
    mods = _modules()

    def resolve(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph = nx.DiGraph()
    for mod, path in mods.items():
        graph.add_node(mod)
        tree = ast.parse(path.read_text())
        typing_only = {id(node) for branch in ast.walk(tree)
                       if isinstance(branch, ast.If) and "TYPE_CHECKING" in ast.unparse(branch.test)
                       for stmt in branch.body for node in ast.walk(stmt)}
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = anchor + ("." + base if base else "")
                # `from pkg import submodule` imports the submodule; `from pkg import name` the package
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names
                           if not a.name.startswith("_C")]
            else:
                continue
            for target in targets:
                if target.split(".")[0] == "dcp" and resolve(target) not in ("", mod):
                    graph.add_edge(mod, resolve(target))
    return graph


def folder_of(module: str) -> str:
    """``dcp.planner.pack`` → ``dcp.planner``; a top-level module is a room of its own."""
    return ".".join(module.split(".")[:2])


def test_no_module_imports_itself_through_others():
    loops = [sorted(c) for c in nx.strongly_connected_components(import_graph()) if len(c) > 1]
    assert not loops, f"import loops: {loops}"


def test_folders_form_a_dag():
    graph = import_graph()
    folders = nx.DiGraph()
    for a, b in graph.edges:
        fa, fb = folder_of(a), folder_of(b)
        if fa != fb and "dcp" not in (fa, fb):  # dcp/__init__ re-exports the public API: above everything
            folders.add_edge(fa, fb, via=(a, b))
    loops = [sorted(c) for c in nx.strongly_connected_components(folders) if len(c) > 1]
    detail = [folders.edges[e]["via"] for c in loops for e in folders.subgraph(c).edges]
    assert not loops, f"folder loops {loops} through {detail}"
    # the pipeline's order: a lower stage never imports a higher one
    order = ["dcp.masks", "dcp.spec", "dcp.layout", "dcp.ir", "dcp.schedule", "dcp.baselines", "dcp.planner",
             "dcp.execute", "dcp.integration"]
    for low, high in zip(order, order[1:]):
        assert not nx.has_path(folders, low, high), f"{low} reaches up to {high}"


def test_top_level_holds_inputs_and_entry_points_only():
    top = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    assert len(top) <= 12, top
    for path in PACKAGE.iterdir():
        if path.is_dir() and path.name != "__pycache__" and (path / "__init__.py").exists():
            doc = ast.get_docstring(ast.parse((path / "__init__.py").read_text()))
            assert doc, f"dcp/{path.name}/__init__.py says nothing about its stage"
