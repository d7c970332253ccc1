"""Architecture rules checked on the source: which package may know what.

Each rule is its own test function (more rules are added here as the layering is enforced).
"""

from __future__ import annotations

import ast
from pathlib import Path

from dsl_lit.config.families import family_names

SRC = Path(__file__).resolve().parents[2] / "src" / "dsl_lit"
MODELS = SRC / "models"
FAMILIES = SRC / "config" / "families"

# -- model families are known only inside dsl_lit.models and their cards -------------------------------

FAMILY_ID_ALLOWED = {
    ("scaling/planner/layout.py", "deepseek_v3"): (
        "plan.recompute=deepseek_v3 (README) names DeepSeek-V3's activation-recompute recipe, which "
        "the planner applies to any model; it is not compared with ModelConfig.family"
    ),
}
"""(file under src/dsl_lit, string) -> why that family-id-shaped string is not a family id there."""


def family_id_uses(source: str, family_ids: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line, what) for every string literal equal to a family id and every comparison involving a
    ``.family`` attribute: the two ways code outside ``dsl_lit.models`` and the family cards
    (``config/families/``) would branch on a family."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in family_ids:
            found.append((node.lineno, node.value))
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(isinstance(o, ast.Attribute) and o.attr == "family" for o in operands):
                found.append((node.lineno, "a comparison with .family"))
    return found


def test_family_id_scanner_finds_what_it_looks_for() -> None:
    ids = ("alpha_family",)
    source = 'x = cfg.family == other\nif "alpha_family" in names:\n    y = {"alpha_family": 1}\n'
    assert family_id_uses(source, ids) == [(1, "a comparison with .family"), (2, "alpha_family"), (3, "alpha_family")]
    assert family_id_uses('"""alpha_family in prose is fine."""\nname = cfg.family\n', ids) == []


def test_no_python_file_outside_models_names_a_family_id() -> None:
    ids = family_names()
    assert len(ids) >= 2
    violations = []
    used_allowances = set()
    for path in sorted(SRC.rglob("*.py")):
        if MODELS in path.parents or FAMILIES in path.parents:
            continue
        relative = path.relative_to(SRC).as_posix()
        for line, what in family_id_uses(path.read_text(encoding="utf-8"), ids):
            if (relative, what) in FAMILY_ID_ALLOWED:
                used_allowances.add((relative, what))
            else:
                violations.append(f"{relative}:{line}: {what}")
    assert not violations, "family ids are looked up only in dsl_lit.models and config/families (cards, registry):\n" + "\n".join(
        violations
    )
    assert used_allowances == set(FAMILY_ID_ALLOWED), "an allowance no longer needed: remove it"


# -- dsl_lit.config is the bottom layer: it reaches nothing above itself -----------------------------


def test_config_imports_nothing_above_itself() -> None:
    """``dsl_lit.config`` imports nothing else from dsl_lit, lazily or not: the family cards and the
    parts of a model config live in it (``config/families/``, ``config/model_parts/``), so no
    inversion point is left (before: ``config/model.py`` reached ``dsl_lit.models.families`` lazily,
    the one circle of the structure drawing)."""
    found = []
    for path in sorted((SRC / "config").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            found += [(path.relative_to(SRC).as_posix(), m) for m in modules
                      if m.startswith("dsl_lit") and not m.startswith("dsl_lit.config")]
    assert found == []


def test_a_model_config_is_built_and_validated_without_torch() -> None:
    """The family cards and their parts answer what a config asks (presets, checks, shapes) without
    torch and without the model code."""
    import subprocess
    import sys

    code = (
        "import sys; from dsl_lit.config.model import ModelConfig;"
        "cfgs = [ModelConfig().validate(), ModelConfig.from_name('deepseek_v3_tiny'), ModelConfig.from_name('deepseek_v2_tiny')];"
        "print([(c.kv_heads, c.rope_dim, c.is_moe, c.mtp_modules) for c in cfgs]);"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith('dsl_lit.models'));"
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_attention_kinds_answer_the_shape_questions():
    """FLOPs, pipeline costs and the planner ask the config's attention part (``AttentionShape``),
    never branch on which kind it is: every attention module answers every question as its part
    does, every part has the planner's row, and no module outside ``dsl_lit.models`` reads
    ``latent_attention``."""
    import inspect

    from dsl_lit.config.families import CARDS
    from dsl_lit.config.model_parts.attention import AttentionShape
    from dsl_lit.models.common.attention import GroupedQueryAttention
    from dsl_lit.models.common.dsa import SparseLatentAttention
    from dsl_lit.models.common.mla import MultiHeadLatentAttention
    from dsl_lit.models.deepseek_v4.attention import V4Attention
    from dsl_lit.scaling.planner.attention_costs import ATTENTION_COSTS, AttentionCosts

    questions = [name for name, _ in inspect.getmembers(AttentionShape, inspect.isfunction) if not name.startswith("_")]
    assert len(questions) >= 5
    for kind in (GroupedQueryAttention, MultiHeadLatentAttention, SparseLatentAttention, V4Attention):
        missing = [q for q in questions if not isinstance(inspect.getattr_static(kind, q), staticmethod)]
        assert not missing, (kind.__name__, missing)
    costs = [name for name, _ in inspect.getmembers(AttentionCosts, inspect.isfunction) if not name.startswith("_")]
    assert len(costs) == 5
    for card in CARDS.values():
        row = next(ATTENTION_COSTS[k] for k in card.attention.__mro__ if k in ATTENTION_COSTS)
        assert all(isinstance(inspect.getattr_static(row, q), staticmethod) for q in costs), card.name
    planner = Path(__file__).resolve().parents[2] / "src" / "dsl_lit" / "scaling"
    assert not [p.name for p in planner.rglob("*.py") if "latent_attention" in p.read_text(encoding="utf-8")]
    outside = [p for p in SRC.rglob("*.py") if MODELS not in p.parents]
    assert not [str(p.relative_to(SRC)) for p in outside if "latent_attention" in p.read_text(encoding="utf-8")]


# -- a model is changed from outside in one place, by one caller -------------------------------------


def calls_of(name: str) -> list[str]:
    """``file:line`` of every call of a function named ``name`` in src/dsl_lit."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                if called == name:
                    found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    return found


def test_one_hook_transforms_the_model() -> None:
    """Before: 4 callers in 3 files (both strategies' setup paths and the module's fallback, chosen
    by a flag); now the strategies' shared hook alone (``parallel/model_setup.py``)."""
    assert [c.split(":")[0] for c in calls_of("transform_model")] == ["parallel/model_setup.py"]
    # the run-wide decisions (precision=auto among them) are made in one place too
    assert [c.split(":")[0] for c in calls_of("resolve_precision")] == ["training/run_plan.py"]
