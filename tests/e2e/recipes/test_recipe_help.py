"""A recipe's ``--help``: the groups it composes (only those) with their options, each key with its
value and meaning from the config dataclasses' docstrings, exit 0, before torch is imported."""

from __future__ import annotations

import ast
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsl_lit.config.help import HelpPage, print_recipe_help, read_classes, yaml_comments
from tests.conftest import ROOT

RECIPES = sorted((ROOT / "recipes").glob("*.py"))


def recipe_help(name: str, *args: str) -> tuple[str, float]:
    """``python recipes/<name>.py --help`` as a user runs it: (stdout, seconds); asserts it exits 0
    without importing torch (``-X importtime`` lists every module imported)."""
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-X", "importtime", str(ROOT / "recipes" / f"{name}.py"), *args, "--help"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    seconds = time.perf_counter() - start
    assert result.returncode == 0, result.stderr[-3000:]
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert not {m for m in imported if m.split(".")[0] in ("torch", "lightning")}, "torch imported for --help"
    return result.stdout, seconds


def groups_of(page: str) -> dict[str, str]:
    """The "Config groups" block: group -> its default option."""
    block = page.split("== Config groups", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    return dict(line.strip().split(";")[0].split(": ", 1) for line in block if line.startswith("  ") and
                not line.startswith("      "))


def explained(page: str, key_value: str) -> str:
    """The explanation printed under the line ``key=value``."""
    lines = page.splitlines()
    at = lines.index(f"  {key_value}")
    below = []
    for line in lines[at + 1:]:
        if not line.startswith("      "):
            break
        below.append(line.strip())
    return " ".join(below)


def test_pretrain_and_grpo_help_list_only_their_groups_and_explain_keys():
    page, seconds = recipe_help("pretrain")
    assert groups_of(page) == {
        "model": "deepseek_v3_tiny", "data": "bundled", "optim": "adamw", "schedule": "multi_step",
        "precision": "fp32", "parallel": "single", "logger": "wandb", "checkpoint": "default", "trainer": "cpu_demo",
        "objective": "deepseek_v3", "memory": "default", "eval": "default", "profiler": "default",
        "experiment": "cpu_demo"}
    assert "also cpu_context_128" in page and "tp2" in page  # the options of a group
    # the values are this recipe's (the cpu_demo experiment's lr and seq_len), the meaning the field's docstring
    assert explained(page, "optim.lr=0.002").startswith("Peak learning rate")
    assert explained(page, "data.seq_len=128").startswith("Tokens per training sequence")
    assert "(conf/experiment/cpu_demo.yaml)" in explained(page, "data.seq_len=128")  # why the experiment sets it
    assert "Validate on `data.val_windows`" in explained(page, "trainer.val_every_n_steps=50")
    assert explained(page, "+model.n_routed_experts=16  (int; the preset's)") == ""
    assert "Routed experts per token" in explained(page, "+model.n_activated_experts=4  (int; the preset's)")
    assert seconds < 20, seconds  # ~1 s alone; torch and Lightning alone take 5-15 s to import

    page, _ = recipe_help("grpo", "model=deepseek_llm_7b")
    groups = groups_of(page)
    assert groups["task"] == "largest" and groups["grpo"] == "default" and groups["model"] == "deepseek_llm_7b"
    assert not {"experiment", "objective", "cluster", "reproduce", "plan_experiment"} & set(groups)
    assert explained(page, "grpo.group_size=8").startswith("G: completions sampled per prompt")
    assert explained(page, "optim.lr=0.0002").startswith("Peak learning rate")
    assert "+model.n_layers" not in page and "model.n_layers=2" in page  # grpo.yaml sets it: no + needed


def test_help_sections_filter_and_a_bad_override_is_one_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        print_recipe_help(ROOT / "recipes" / "sft.py", ["-m", "optim.lr=1e-3,3e-3", "data.seq_len=64", "optim", "data"])
    assert exit_.value.code == 0
    page = capsys.readouterr().out
    assert "\noptim:\n" in page and "\ndata:\n" in page and "\nmodel:\n" not in page and "\nsft:\n" not in page
    assert "  data.seq_len=64" in page and "  optim.lr=0.003" in page  # a sweep's values: the default shown
    with pytest.raises(SystemExit) as exit_:
        print_recipe_help(ROOT / "recipes" / "sft.py", ["model=no_such_preset"])
    assert exit_.value.code == 2
    assert "Could not find 'model/no_such_preset'" in capsys.readouterr().err


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_has_a_help_page(recipe: Path):
    """Every recipe answers --help first (before its imports load torch), and its page composes."""
    body = ast.parse(recipe.read_text(encoding="utf-8")).body
    first = next(i for i, node in enumerate(body) if isinstance(node, ast.If) and "print_recipe_help" in ast.unparse(node))
    before = [alias.name if isinstance(node, ast.Import) else node.module for node in body[:first]
              if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names]
    assert set(before) <= {"__future__", "sys"}, before
    page = HelpPage(recipe).text()
    assert page.startswith(f"recipes/{recipe.name}: ")
    assert "== Keys" in page


def test_keys_of_config_store_and_plain_recipes():
    """evaluate.py composes from Hydra's config store, export_hf.py parses key=value itself: their
    keys are top-level and explained from the dataclass (evaluate) or the YAML (both)."""
    page = HelpPage(ROOT / "recipes" / "evaluate.py").text()
    assert "== Config groups" not in page and "top-level keys (conf/evaluate.yaml):" in page
    assert "Usage: python recipes/evaluate.py [key=value ...] [+key=value ...]; -m sweeps" in page
    assert "  tasks=[dsl_kjv_next_sentence, dsl_devil_perplexity, dsl_arithmetic]" in page
    page = HelpPage(ROOT / "recipes" / "export_hf.py").text()
    assert "Usage: python recipes/export_hf.py [key=value ...]\n" in page and "--cfg job" not in page
    assert explained(page, "checkpoint=???").startswith("checkpoints/step-<N>/, or a run dir")


def test_docs_come_from_docstrings_trailing_comments_and_yaml(tmp_path):
    source = tmp_path / "schema.py"
    source.write_text(
        "from dataclasses import dataclass\n\n\n@dataclass\nclass Group:\n"
        '    """The ``group`` group: see :attr:`b`."""\n\n'
        "    a: int = 1  # a trailing comment\n"
        "    b: float = 1e12\n"
        '    """An attribute\n    docstring over two lines."""\n'
        "    c: list[int] | None = None\n"
    )
    group = read_classes(source)["Group"]
    assert group.doc == "The `group` group: see `b`."
    assert {k: (f.annotation, f.doc, f.default) for k, f in group.fields.items()} == {
        "a": ("int", "a trailing comment", "1"), "b": ("float", "An attribute docstring over two lines.", "1e12"),
        "c": ("list[int] | None", "", "null")}
    yaml = tmp_path / "option.yaml"
    yaml.write_text(
        "# What this option is.\n"
        "x: 1        # x's comment\n"
        "            # continued in the same column\n"
        "# the comment above y\n"
        "y: '#not a comment'\n"
        "nested:     # a section\n"
        "  z: ${oc.env:A,#b}  # z's\n"
    )
    package, header, comments = yaml_comments(yaml, "grp")
    assert (package, header) == ("grp", "What this option is.")
    assert comments == {"grp.x": "x's comment continued in the same column", "grp.y": "the comment above y",
                        "grp.nested": "a section", "grp.nested.z": "z's"}
    yaml.write_text("# @package _global_\n# header\noptim:\n  lr: 1  # why\n")
    assert yaml_comments(yaml, "experiment") == ("", "header", {"optim.lr": "why"})


def test_cfg_job_shows_the_config_the_run_would_train_with(tmp_path):
    """``--cfg job`` of a training recipe: the validated, resolved config (the model field by field,
    its parameter counts, the layout), as resolved_config.yaml and W&B hold it; before, Hydra's
    composition showed the model as ``{name: deepseek_llm_tiny}``. A bad value: one line, exit 2.
    A recipe that is no training run (evaluate.py) keeps Hydra's own print."""
    import yaml

    from tests.forked_python import run_python

    def cfg_job(recipe: str, *overrides: str) -> subprocess.CompletedProcess:
        return run_python([sys.executable, str(ROOT / "recipes" / f"{recipe}.py"), "--cfg", "job", *overrides],
                          cwd=tmp_path, timeout=300)

    shown = cfg_job("pretrain", "model=deepseek_llm_tiny", "+model.n_layers=2")
    assert shown.returncode == 0, shown.stderr[-2000:]
    view = yaml.safe_load(shown.stdout)
    assert view["model"]["name"] == "deepseek_llm_tiny" and view["model"]["n_layers"] == 2
    assert view["model"]["n_kv_heads"] == 4 and view["derived"]["parameters"]["total"] > 0
    assert view["derived"]["layout"]["world_size"] == 1 and not list(tmp_path.iterdir())  # no run dir made
    bad = cfg_job("sft", "optim.lr=-1")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: optim.lr=-1 must be > 0")
    assert "Traceback" not in bad.stderr
    other = cfg_job("evaluate")
    assert other.returncode == 0 and "tasks:" in other.stdout and "derived" not in other.stdout
    assert "UserWarning" not in other.stderr  # it is not composed twice (Hydra warned about its ConfigStore node)
