"""A recipe runs the dsl_lit of its own clone: run with another clone's Python (whose editable
install points at that clone's ``src/``), it stops with one line (exit 2) instead of mixing this
clone's ``conf/`` with the other clone's code."""

from __future__ import annotations

import shutil
import subprocess
import sys

from tests.conftest import ROOT


def test_a_recipe_run_with_another_clones_python_is_refused(tmp_path):
    other = tmp_path / "other_clone"
    (other / "recipes").mkdir(parents=True)
    (other / "src" / "dsl_lit").mkdir(parents=True)
    (other / "src" / "dsl_lit" / "__init__.py").write_text("")
    shutil.copy(ROOT / "recipes" / "plan.py", other / "recipes" / "plan.py")
    (other / "conf").symlink_to(ROOT / "conf")
    result = subprocess.run([sys.executable, str(other / "recipes" / "plan.py")], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        f"error: {other / 'recipes' / 'plan.py'} belongs to the clone {other}, but this Python ({sys.executable}) "
        f"imports dsl_lit from {ROOT / 'src' / 'dsl_lit'}: run it with {other}/.venv/bin/python (make setup there)"]
    # a recipe copied outside any clone (copy-and-edit) runs with the installed dsl_lit; this clone's own too
    from dsl_lit.training.runs import check_source_tree

    check_source_tree(str(tmp_path / "my_recipes" / "plan.py"))
    check_source_tree(str(ROOT / "recipes" / "plan.py"))
