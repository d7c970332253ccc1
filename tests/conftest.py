"""Shared test helpers: composing the real Hydra configs of the recipes."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from dsl_lit.config.resolvers import register_resolvers

ROOT = Path(__file__).resolve().parents[1]
register_resolvers()  # ${project_root:} for the configs the tests compose
CONF = ROOT / "conf"
# Context-extension stages pack their data with the previous stage's tokenizer (the token ids its
# weights were trained on), which a fresh checkout has not built yet: composition tests drop it.
AFTER_A_STAGE = {"experiment=cpu_context_512": "data.tokenizer_dir=null",
                 "experiment=cpu_context_2048": "data.tokenizer_dir=null",
                 # the DSA warm-up names no checkpoint (the user's V3 run): composition tests give one
                 "experiment=cpu_dsa_warmup": "init_from=outputs/pretrain/v3_base"}


def with_stage_inputs(overrides: list[str]) -> list[str]:
    return overrides + [AFTER_A_STAGE[o] for o in overrides if o in AFTER_A_STAGE]


def scratch_dir(request: pytest.FixtureRequest, name: str) -> Path:
    """A fresh directory for a module-scoped fixture, removed when that fixture is torn down (its
    module ends, or its next parameter starts) unless a test failed meanwhile, as pytest's own
    `tmp_path_retention_policy = "failed"` does for `tmp_path`. Kept to the session's end, the
    fixtures' recipe runs and checkpoints reached 15 GB and filled CI's disk; removed, a worker holds
    only the runs of the module it is in."""
    directory = request.getfixturevalue("tmp_path_factory").mktemp(name)
    failed_before = request.session.testsfailed

    def remove() -> None:
        if request.session.testsfailed == failed_before:
            shutil.rmtree(directory, ignore_errors=True)

    request.addfinalizer(remove)
    return directory

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # pytest -n N: N workers share the cores, so each one's in-process torch ops use its share (the
    # recipes they start in subprocesses keep torch's default)
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Every recipe the tests run (subprocesses inherit this) builds its tokenizer and shards afresh in a
# session cache, so a regression in tokenizer training or packing cannot hide behind the
# repository's warm .cache/ (set DSL_LIT_CACHE_ROOT yourself to reuse one between sessions).
if "DSL_LIT_CACHE_ROOT" not in os.environ:
    os.environ["DSL_LIT_CACHE_ROOT"] = tempfile.mkdtemp(prefix="dsl_lit_test_cache_")
    atexit.register(shutil.rmtree, os.environ["DSL_LIT_CACHE_ROOT"], ignore_errors=True)


@pytest.fixture(autouse=True)
def _eager_cross_entropy_after_each_test():
    """A test that applies ``trainer.compile``'s transform in this process switches the cross-entropy's
    chunk kernels to compiled ones (process-wide, as in a run): the next test starts eager again."""
    yield
    from dsl_lit.ops import compile_chunk_kernels

    compile_chunk_kernels(None)


def compose_config(name: str = "pretrain", overrides: list[str] | None = None) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=name, overrides=overrides or [], return_hydra_config=False)


@pytest.fixture
def compose_cfg():
    return compose_config


def edit_config_json(path: Path, **changes: object) -> None:
    """Overwrite keys of a saved Hugging Face ``config.json`` (tests of bad checkpoints)."""
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


# The multi-process tests (marked slow) of one file share module-scoped runs, so `make test` hands
# out whole files (pytest-xdist's --dist loadfile) in collection order (--no-loadscope-reorder); the
# order is longest file first by the seconds tests/durations.json recorded (longest processing time
# first: the suite ends when its last long file does, and short files fill the cores at the end).
# Refresh it after a full run: `pytest ... --junitxml=F && python scripts/record_test_durations.py F`.
# A file not recorded yet counts as UNRECORDED_S. (--dist loadgroup would group single tests, but
# pytest-xdist 3.8 marks a group by rewriting item._nodeid, which pytest 9 no longer reads: its groups
# are silently split.)
DURATIONS = Path(__file__).with_name("durations.json")
UNRECORDED_S = 30.0


def _recorded_seconds() -> dict[str, float]:
    return json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}


def _schedule_key(seconds: dict[str, float]):
    def key(item: pytest.Item) -> float:
        return -seconds.get(str(item.path.relative_to(ROOT)), UNRECORDED_S)
    return key


NO_GPU = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False (run them with scripts/gpu_check.sh)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_schedule_key(_recorded_seconds()))  # stable: a file's tests keep pytest's order (module fixtures)
    import torch

    if not torch.cuda.is_available():
        for item in items:
            if item.get_closest_marker("gpu") is not None:
                item.add_marker(NO_GPU)


_IN_XDIST_WORKER = False


def pytest_configure(config: pytest.Config) -> None:
    global _IN_XDIST_WORKER
    # from the config, not PYTEST_XDIST_WORKER: a pytest that a test starts inherits that variable
    _IN_XDIST_WORKER = hasattr(config, "workerinput")


def pytest_collection_finish(session: pytest.Session) -> None:
    """With ``DSL_LIT_TEST_COLLECTED`` set (scripts/gpu_check.sh), append the ids of the tests this run
    selected to that file: what a part meant to run, so that its summary names every test a deadline
    cut. Each pytest-xdist worker collects and writes the same list (the summary reads each id once)."""
    path = os.environ.get("DSL_LIT_TEST_COLLECTED")
    if path and session.items:
        with open(path, "a") as f:
            f.write("".join(f"{item.nodeid}\n" for item in session.items))


def first_error_line(report: pytest.TestReport) -> str:
    """The line that says what went wrong: the first ``E`` line of the traceback (else its last)."""
    text = str(report.longrepr).strip().splitlines() if report.longrepr else []
    errors = [line[1:].strip() for line in text if line.startswith("E ")]
    return (errors or [line.strip() for line in text[-1:]] or [""])[0][:300].replace("\t", " ")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With ``DSL_LIT_TEST_RESULTS`` set (scripts/gpu_check.sh), append each test's outcome to that
    file the moment it is known (test, outcome, seconds, first error line; tab-separated), in the
    process that reports (pytest-xdist's controller), so a run cut by a deadline keeps what finished."""
    path = os.environ.get("DSL_LIT_TEST_RESULTS")
    if not path or _IN_XDIST_WORKER:
        return
    ended = report.when == "call" or (report.when == "setup" and not report.passed) or (
        report.when == "teardown" and report.failed)
    if not ended:
        return
    error = first_error_line(report) if report.failed else (
        str(report.longrepr[-1]) if report.skipped and isinstance(report.longrepr, tuple) else "")
    with open(path, "a") as f:
        f.write(f"{report.nodeid}\t{report.outcome}\t{report.duration:.0f}\t{error}\n")


def _tree_cpu_seconds(root: int) -> float:
    """CPU seconds of process ``root`` and its live descendants, each with its waited-for children's
    (a recipe run that ended is counted in the zygote or pytest worker that waited for it)."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    seconds: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        parents[int(entry)] = int(fields[1])
        seconds[int(entry)] = sum(int(x) for x in fields[11:15]) / tick
    tree, grew = {root}, True
    while grew:
        grown = tree | {pid for pid, parent in parents.items() if parent in tree}
        grew, tree = grown != tree, grown
    return sum(seconds.get(pid, 0.0) for pid in tree)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """With ``DSL_LIT_TEST_CPU`` naming a folder (Linux): each test's CPU seconds (this process and
    every process it started), one JSON line per test in ``<folder>/<worker>.jsonl``: on two cores
    the suite is CPU-bound, so these, not the wall times, say what a cut saves."""
    folder = os.environ.get("DSL_LIT_TEST_CPU")
    if not folder:
        yield
        return
    before = _tree_cpu_seconds(os.getpid())
    yield
    spent = _tree_cpu_seconds(os.getpid()) - before
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    Path(folder).mkdir(parents=True, exist_ok=True)  # (a missing folder was an internal error mid-test)
    with open(Path(folder) / f"{worker}.jsonl", "a") as f:
        f.write(json.dumps({"test": item.nodeid, "cpu_s": round(spent, 2)}) + "\n")
