"""The suite's disk: run directories and checkpoints leave the disk when their tests pass. Kept to the
session's end they reached 15 GB (3 workers) and filled CI's disk mid-run (session 28's submission)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytest_plugins = ["pytester"]

MODULE_FIXTURE = """
from pathlib import Path

import pytest
from tests.conftest import scratch_dir

@pytest.fixture(scope="module", params=["a", "b"])
def run(request):
    directory = scratch_dir(request, request.param)
    (directory / "checkpoint.bin").write_bytes(b"x" * 1000)
    return directory

def test_uses(run):
    Path(f"{run.name}.path").write_text(str(run))  # the inner run's working directory
    assert {FAIL_ON!r} not in run.name
"""


def test_passed_tests_tmp_path_is_removed() -> None:
    assert re.search(r'^tmp_path_retention_policy = "failed"$', (ROOT / "pyproject.toml").read_text(), re.M)


@pytest.mark.parametrize("fail_on", ["nothing", "b"])
def test_a_module_fixtures_scratch_dir_goes_at_its_teardown_unless_a_test_failed(pytester, fail_on) -> None:
    pytester.makepyfile(test_scratch=MODULE_FIXTURE.replace("{FAIL_ON!r}", repr(fail_on)))
    result = pytester.runpytest_inprocess("-p", "no:xdist", f"--rootdir={pytester.path}")
    failed = fail_on != "nothing"
    result.assert_outcomes(passed=1 if failed else 2, failed=1 if failed else 0)
    first, second = (Path((pytester.path / f"{name}.path").read_text()) for name in ("a0", "b0"))
    assert first.parent == second.parent  # both under the inner session's basetemp, which remains
    assert not first.exists()  # its test passed: removed when parameter "b" began
    assert second.exists() == failed  # kept for the failure's post-mortem


def test_no_test_module_keeps_fixture_directories_to_the_sessions_end() -> None:
    """Module fixtures take their directories from scratch_dir, not tmp_path_factory.mktemp."""
    offenders = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                       if re.search(r"tmp_path_factory\.mktemp\(", p.read_text()))
    assert offenders == [], f"use tests.conftest.scratch_dir(request, name) in: {offenders}"
