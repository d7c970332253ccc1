"""The import direction of ARCHITECTURE.md, checked on the source: config <- models <- parallel /
precision <- training <- recipes, and the module never names the Strategy."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "dsl_lit"


def _imports(path: Path, top_level_only: bool = False, run_time_only: bool = False) -> set[str]:
    """Every module a file imports (absolute names), at any depth (lazy imports included) or only
    at module level; ``run_time_only``: less what sits under ``if TYPE_CHECKING:`` (names of types).
    ``from data_pipeline... import x`` also counts as ``data_pipeline....x`` (``x`` may be a module)."""
    names: set[str] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    if run_time_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
                node.body = []
    for node in (tree.body if top_level_only else ast.walk(tree)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            if node.module.split(".")[0] == "data_pipeline":
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_config_imports_nothing_else_from_dsl_lit():
    """At import time (its one lazy lookup of the family cards is pinned in test_architecture)."""
    offenders = {
        str(path.relative_to(SRC)): sorted(m for m in _imports(path, top_level_only=True)
                                          if m.startswith("dsl_lit") and not m.startswith("dsl_lit.config"))
        for path in (SRC / "config").rglob("*.py")
    }
    assert not {k: v for k, v in offenders.items() if v}


def test_importing_the_config_loads_no_lightning_module_or_strategy():
    code = (
        "import sys, dsl_lit.config, dsl_lit.config.posttrain;"
        "loaded = [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')"
        " or m.startswith(('dsl_lit.training', 'dsl_lit.posttrain', 'dsl_lit.parallel', 'dsl_lit.models'))];"
        "print(loaded); assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_modules_do_not_name_the_strategy():
    modules = [SRC / "training" / "causal_lm.py", SRC / "training" / "pretrain.py", *(SRC / "posttrain").rglob("module.py")]
    assert {p.parent.name for p in modules if p.name == "module.py"} >= {"sft", "dpo", "grpo", "rejection"}
    for path in modules:
        text = path.read_text(encoding="utf-8")
        assert "DeepSeekStrategy" not in text, f"{path.name} names the Strategy; use self.runner"
        assert "dsl_lit.parallel.strategy" not in _imports(path), path.name


def test_models_import_no_upper_layer():
    upper = ("dsl_lit.parallel", "dsl_lit.posttrain", "dsl_lit.training", "dsl_lit.precision", "dsl_lit.hf",
             "dsl_lit.training.callbacks", "dsl_lit.training.build", "lightning")
    for path in (SRC / "models").rglob("*.py"):
        bad = sorted(m for m in _imports(path) if m.startswith(upper))
        assert not bad, f"{path.relative_to(SRC)} imports {bad}"


def test_inference_and_training_import_no_upper_layer():
    """Generation serves post-training, evaluation and the training loop: it imports only the
    models; training (and evaluation) never import post-training."""
    for path in (SRC / "inference").rglob("*.py"):
        bad = sorted(m for m in _imports(path) if m.startswith("dsl_lit") and not m.startswith(
            ("dsl_lit.inference", "dsl_lit.models", "dsl_lit.config")))
        assert not bad, f"{path.relative_to(SRC)} imports {bad}"
    for package in ("training", "evaluation"):
        for path in (SRC / package).rglob("*.py"):
            bad = sorted(m for m in _imports(path) if m.startswith(("dsl_lit.posttrain", "dsl_lit.evaluation.cli")))
            assert not bad, f"{path.relative_to(SRC)} imports {bad}"


def _layer_order() -> list[str]:
    """The packages of ARCHITECTURE.md's table, top to bottom."""
    text = (SRC.parents[1] / "ARCHITECTURE.md").read_text(encoding="utf-8")
    block = text.split("```", 2)[1]
    return [line.split()[0].removeprefix("dsl_lit.") for line in block.splitlines() if line.startswith("dsl_lit.")]


def test_every_import_points_down_architecture_mds_table():
    """Every ``dsl_lit`` import of every module (lazy ones included) goes to its own package or one
    below it in ARCHITECTURE.md's table; the table names every package."""
    order = _layer_order()
    packages = sorted(p.name.removesuffix(".py") for p in SRC.iterdir()
                      if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.name != "__init__.py"))
    assert sorted(order) == packages, "ARCHITECTURE.md's table and src/dsl_lit differ"
    rank = {name: i for i, name in enumerate(order)}
    allowed = {("config", "models")}  # config's lazy lookup of the family cards (test_architecture pins it)
    upward = []
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).parts
        mine = parts[0].removesuffix(".py")
        if mine == "__init__":
            continue
        for module in _imports(path):
            if not module.startswith("dsl_lit."):
                continue
            target = module.split(".")[1]
            if target != mine and rank[target] < rank[mine] and (mine, target) not in allowed:
                upward.append(f"{path.relative_to(SRC)} -> {module}")
    assert not upward, upward


PIPELINE = SRC.parents[1] / "data_pipeline"
# The rooms of data_pipeline/, top to bottom (ARCHITECTURE.md): a module imports its own tier or one
# below it at run time (imports under ``if TYPE_CHECKING:`` name types only and are not counted).
PIPELINE_TIERS = (
    ("__main__", "runner", "config", "registry", "report", "executors"),  # the program
    ("stages",),
    ("dedup", "filters", "tokenizer", "document_step", "stage"),
    ("io", "peak_memory", "synthetic"),
    ("context",),
)
CONTRACT = SRC.parent / "data_contract"


def test_pipeline_rooms_import_down_and_neither_side_imports_the_other():
    """data_pipeline's rooms import down; it and dsl_lit share only ``data_contract`` (the shard
    format, corpus fingerprint, tokenizer-directory meta, chat-template sandbox, atomic publish,
    config errors), which imports neither. Before: data_pipeline imported 7 dsl_lit modules."""
    tier = {room: i for i, rooms in enumerate(PIPELINE_TIERS) for room in rooms}
    rooms = {p.name.removesuffix(".py") for p in PIPELINE.iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.name != "__init__.py")}
    assert rooms == set(tier), "PIPELINE_TIERS and data_pipeline/ differ"
    upward, crossing = [], []
    for path in PIPELINE.rglob("*.py"):
        parts = path.relative_to(PIPELINE).parts
        mine = parts[0].removesuffix(".py")
        if mine == "__init__":
            continue
        for module in _imports(path, run_time_only=True):
            if module.startswith("data_pipeline."):
                target = module.split(".")[1]
                if target != mine and tier[target] < tier[mine]:
                    upward.append(f"{path.relative_to(PIPELINE)} -> {module}")
        crossing += [f"data_pipeline/{path.relative_to(PIPELINE)} -> {m}" for m in _imports(path)
                     if m.split(".")[0] == "dsl_lit"]
    for path in SRC.rglob("*.py"):
        crossing += [f"dsl_lit/{path.relative_to(SRC)} -> {m}" for m in _imports(path)
                     if m.split(".")[0] == "data_pipeline"]
    for path in CONTRACT.rglob("*.py"):
        crossing += [f"data_contract/{path.relative_to(CONTRACT)} -> {m}" for m in _imports(path)
                     if m.split(".")[0] in ("dsl_lit", "data_pipeline")]
    assert not upward, upward
    assert not crossing, crossing
    used = {m for path in PIPELINE.rglob("*.py") for m in _imports(path) if m.split(".")[0] == "data_contract"}
    assert {"data_contract.format", "data_contract.errors"} <= used  # the test sees the pipeline's imports


def _pipeline_import_graph() -> dict[str, set[str]]:
    """Every data_pipeline module (a package by its own name) -> the data_pipeline modules it
    imports: at any depth, lazy ones and those under ``if TYPE_CHECKING:`` included. A module's
    import of its own package (``executors/local.py`` of ``executors/__init__.py``) is not counted:
    that is the package's interface, which may name its modules."""
    modules = {}
    for path in PIPELINE.rglob("*.py"):
        parts = path.relative_to(PIPELINE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name] = set()
        for target in _imports(path):
            while target and target not in modules:  # data_pipeline.stage.Stage -> data_pipeline.stage
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                graph[name].add(target)
    return graph


def _import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that reach each other by imports (strongly connected, two or more)."""
    reach: dict[str, set[str]] = {}
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            for module in graph[todo.pop()] - seen:
                seen.add(module)
                todo.append(module)
        reach[start] = seen
    groups = {frozenset(m for m in reach[start] if start in reach[m]) for start in graph if start in reach[start]}
    return sorted(sorted(group) for group in groups)


def test_pipeline_imports_close_no_circle_type_only_imports_included():
    """No data_pipeline module reaches itself through imports, not even through the ones that only
    name types: a type-only import of a module above (a stage's base importing the config that
    imports every stage) is the same tangle for a reader and for refactoring. Settings a lower room
    reads live there (``dedup/near_dedup_config.py``); ``Context`` and ``Stage`` are handed the
    sections and the stage list, not the ``PipelineConfig``."""
    graph = _pipeline_import_graph()
    assert {"data_pipeline.config", "data_pipeline.context", "data_pipeline.stages.near_dedup"} <= set(graph)
    assert "data_pipeline.registry" in graph["data_pipeline.config"]  # edges are found at all
    circles = _import_circles(graph)
    assert not circles, circles


def test_the_pipeline_runner_and_config_name_no_stage():
    """Ingest and finalize are rows of the registry like every stage (``Stage.phase``,
    ``Stage.always``, ``Stage.reads_input``). Before: the runner imported 4 of ingest's functions
    and config.py inserted ``Ingest`` and ``Finalize`` by hand."""
    assert not [m for m in _imports(PIPELINE / "runner.py") if m.startswith("data_pipeline.stages")]
    named = {m.rpartition(".")[2] for m in _imports(PIPELINE / "config.py") if m.startswith("data_pipeline.stages")}
    assert not named & {"Ingest", "Finalize"}, named
