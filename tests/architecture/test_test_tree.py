"""The tests mirror the house: ``tests/unit/<package>/`` for a package of ``src/dsl_lit``,
``data_pipeline``, ``data_contract`` or ``benchmarks``; ``tests/e2e/`` for recipe runs and runs over
several processes; ``tests/architecture/`` for the structure. No test file outside them."""

from __future__ import annotations

from tests.conftest import ROOT

TESTS = ROOT / "tests"
PACKAGES = {p.name for p in (ROOT / "src" / "dsl_lit").iterdir() if (p / "__init__.py").is_file()} | {
    "data_pipeline", "data_contract", "benchmarks"}


def test_every_test_file_lives_in_the_tree() -> None:
    loose = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert loose == [], f"test files at tests/ itself (move them under unit/<package>, e2e/ or architecture/): {loose}"
    tops = {p.parent.relative_to(TESTS).parts[0] for p in TESTS.rglob("test_*.py")}
    assert tops <= {"unit", "e2e", "architecture"}, tops


def test_unit_folders_are_packages_of_the_source() -> None:
    folders = {p.name for p in (TESTS / "unit").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders, "tests/unit is empty"
    assert folders <= PACKAGES, f"tests/unit folders that name no package: {sorted(folders - PACKAGES)}"
    for folder in folders:  # packages, so that two folders may hold files of the same name
        assert (TESTS / "unit" / folder / "__init__.py").is_file(), folder


def test_the_schedule_knows_every_file_by_its_path() -> None:
    """tests/durations.json is keyed by the paths pytest reports; a moved file must not fall back to
    the unrecorded default (the scheduler would start the longest files late)."""
    import json

    recorded = json.loads((TESTS / "durations.json").read_text())
    stale = sorted(path for path in recorded if not (ROOT / path).is_file())
    assert stale == [], f"tests/durations.json names files that do not exist: {stale}"
