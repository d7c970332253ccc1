"""The command that resumes a run, printed wherever a run stops early, and ``run_name=latest``.

A training recipe's run dir is ``outputs/<recipe>/${run_name}`` and ``run_name`` defaults to the
start time, so "rerun the same command" starts a new run: the command that resumes pins the run's
resolved ``run_name``. :func:`resume_command` rebuilds it from the command line as invoked (the
script, the user's overrides, Hydra's own options) with ``run_name=<this run's name>`` in place of
any ``run_name`` given; pasted in the directory the run was started from, it resumes from the latest
complete checkpoint of the same run dir. :func:`stop_hint` is the text every stop message ends with
(SIGTERM, a lost rank, a bad-step stop): the run dir and that command.

``run_name=latest`` resumes the newest run of a recipe. Why a reserved value of ``run_name`` rather
than a new ``resume=latest`` key: ``run_name`` is already what names the run a command continues
(``run_name=<name>`` resumes that run), so "which run" stays one key, it needs no ``+`` (a key the
config does not have would) and no new field in every recipe's config; the cost is that a run cannot
be *named* ``latest``. It is resolved by :class:`ResolveLatestRun`, a Hydra callback that every
training recipe's config lists under ``hydra.callbacks``: it runs before Hydra creates the run dir
(which ``outputs/<recipe>/${run_name}`` names), replaces ``latest`` by the name of the run under that
outputs folder whose latest complete checkpoint is the newest, and exits 2 with one line when no run
there has a complete checkpoint.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

log = logging.getLogger(__name__)

LATEST = "latest"
"""The ``run_name`` value that means "the newest run of this recipe with a complete checkpoint"."""

_RUN_NAME = re.compile(r"^(\+{0,2}run_name=|~run_name(=|$))")
# Hydra's options that take a value as the next argument (``--config-name x``).
_VALUE_OPTIONS = frozenset({"-cn", "--config-name", "-cp", "--config-path", "-cd", "--config-dir", "-c", "--cfg",
                            "-p", "--package", "--experimental-rerun"})
_MULTIRUN = frozenset({"-m", "--multirun"})
# A multirun's Hydra overrides that a single run of one of its jobs does without.
_SWEEP_ONLY = ("hydra.sweep", "hydra.sweeper", "hydra.launcher", "hydra.run.dir=", "hydra.mode=", "hydra.job.num=")


def resume_command(cfg: Any, argv: Sequence[str] | None = None) -> str:
    """The shell command (``shlex``-quoted) that resumes the run of ``cfg`` (a ``TrainConfig``: its
    ``run_dir`` and ``raw['run_name']``): the recipe as invoked (``argv``, default ``sys.argv``) with
    the user's overrides and ``run_name=<resolved run_name>``. Run it from the directory the run was
    started in (the run dir, ``outputs/<recipe>/<run_name>``, is relative to it).

    A job of a multirun (``-m``) resumes as a single run of that job's overrides with its directory
    pinned (``hydra.run.dir=<job dir>``); in a rank that Lightning's launcher started, the overrides
    that launcher appended are dropped (the launching process's command resumes every rank)."""
    argv = _without_rank_overrides(list(sys.argv if argv is None else argv))
    run_dir = _recipe_run_dir(str(getattr(cfg, "run_dir", ".")))
    raw = getattr(cfg, "raw", None) or {}
    options, overrides = _split(argv[1:])
    job_overrides = _multirun_job_overrides(options)
    if job_overrides is not None:  # a multirun job: its own overrides, its own directory
        kept = [o for o in overrides if o.startswith("hydra.") and not o.startswith(_SWEEP_ONLY)]
        overrides = [*job_overrides, *kept, f"hydra.run.dir={_shown(run_dir)}"]
    if not _fixed_run_dir(overrides):  # the run dir is named by run_name: pin it
        name = _run_name(raw.get("run_name"), run_dir)
        overrides = [o for o in overrides if not _RUN_NAME.match(o)]
        if name:
            overrides.append(f"run_name={name}")
    return shlex.join([*_program(argv[0]), *[o for o in options if o not in _MULTIRUN], *overrides])


def stop_hint(cfg: Any, argv: Sequence[str] | None = None) -> str:
    """``run dir <dir>; resume with: <command>``: what every early stop logs after its reason."""
    launcher = ""
    if os.environ.get("SLURM_JOB_ID"):
        launcher = " (under SLURM: resubmit with this run_name, e.g. sbatch scripts/slurm_pretrain.sh run_name=...)"
    elif os.environ.get("TORCHELASTIC_RUN_ID"):
        launcher = " (under torchrun, with the same torchrun options on every node)"
    return f"run dir {_shown(str(getattr(cfg, 'run_dir', '.')))}; resume with: {resume_command(cfg, argv)}{launcher}"


def _without_rank_overrides(argv: list[str]) -> list[str]:
    """``argv`` less the three overrides Lightning's launcher appends for the ranks it starts."""
    tail = argv[-3:]
    if (len(tail) == 3 and tail[0].startswith("hydra.run.dir=") and re.fullmatch(r"hydra\.job\.name=train_ddp_process_\d+",
                                                                                 tail[1]) and tail[2] == "hydra.output_subdir=null"):
        return argv[:-3]
    return argv


def _fixed_run_dir(overrides: Sequence[str]) -> bool:
    """A ``hydra.run.dir`` override that does not depend on ``run_name``: it alone names the run dir."""
    dirs = [o for o in overrides if o.startswith("hydra.run.dir=")]
    return bool(dirs) and "run_name" not in dirs[-1]


def _split(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """Hydra's options (with their values) and the overrides, in their order."""
    options: list[str] = []
    overrides: list[str] = []
    take_value = False
    for arg in args:
        if take_value:
            options.append(arg)
            take_value = False
        elif arg.startswith("-") and not arg.startswith("~"):
            options.append(arg)
            take_value = arg in _VALUE_OPTIONS
        else:
            overrides.append(arg)
    return options, overrides


def _multirun_job_overrides(options: Sequence[str]) -> list[str] | None:
    """This job's overrides when the process runs a job of a multirun, else None."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not HydraConfig.initialized():
            return None
        hydra_cfg = HydraConfig.get()
        if hydra_cfg.mode != RunMode.MULTIRUN and not _MULTIRUN.intersection(options):
            return None
        return list(hydra_cfg.overrides.task)
    except Exception:  # noqa: BLE001 - no Hydra context (a test, a notebook): the command line as given
        return None


def _recipe_run_dir(run_dir: str) -> str:
    """The recipe's run dir as Hydra made it when ``run_dir`` lies inside it (a stage may train in a
    subfolder, e.g. GRPO's ``cold_start``), else ``run_dir``."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return run_dir
        hydra_dir = Path(str(HydraConfig.get().runtime.output_dir)).absolute()
    except Exception:  # noqa: BLE001 - no Hydra context (a test, a notebook)
        return run_dir
    return str(hydra_dir) if Path(run_dir).absolute().is_relative_to(hydra_dir) else run_dir


def _run_name(name: Any, run_dir: str) -> str | None:
    """The run's name as the run dir holds it: the config's ``run_name`` when the run dir ends with
    it; else the run dir's last part (a rank re-resolves the default ``${now:...}`` a second later, while
    its run dir is the launching process's)."""
    parts = Path(run_dir).parts
    if isinstance(name, str) and name and tuple(Path(name).parts) == parts[-len(Path(name).parts):]:
        return name
    if name is None:
        return None
    return parts[-1] if parts else None


def _program(script: str) -> list[str]:
    """``python <script>`` as invoked (``python`` when it is this interpreter, else its path);
    ``python -m <module>`` for a module run."""
    which = shutil.which("python")
    python = "python" if which and os.path.abspath(which) == os.path.abspath(sys.executable) else _shown(sys.executable)
    if script.endswith(".py") or Path(script).is_file():
        return [python, script]
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return [python, "-m", spec.name] if spec is not None else [python, script]


def _shown(path: str) -> str:
    """``path`` relative to the working directory when it lies inside it, else as given."""
    try:
        relative = os.path.relpath(path)
    except ValueError:
        return path
    return relative if not relative.startswith("..") else path


def latest_run(outputs: str | os.PathLike) -> Path | None:
    """The run dir under ``outputs`` (``outputs/<recipe>``; nested names such as ``exp/a`` included)
    whose latest complete checkpoint was written last, or None when none holds one."""
    from dsl_lit.checkpoint.directory import latest_checkpoint

    root = Path(outputs)
    if not root.is_dir():
        return None
    best: tuple[float, Path] | None = None
    for checkpoints in root.glob("**/checkpoints"):
        if not checkpoints.is_dir():
            continue
        step = latest_checkpoint(checkpoints)
        if step is None:
            continue
        written = max((p.stat().st_mtime for p in step.iterdir()), default=step.stat().st_mtime)
        if best is None or written > best[0]:
            best = (written, checkpoints.parent)
    return best[1] if best else None


def outputs_root(hydra_cfg: Any) -> Path | None:
    """The folder whose subfolders are this recipe's runs: ``hydra.run.dir`` less its ``${run_name}``
    part, or None when ``hydra.run.dir`` does not end with ``${run_name}``."""
    from omegaconf import open_dict, read_write

    sentinel = "@@run_name@@"
    original = hydra_cfg.run_name
    with read_write(hydra_cfg), open_dict(hydra_cfg):
        hydra_cfg.run_name = sentinel
        try:
            run_dir = str(hydra_cfg.hydra.run.dir)
        finally:
            hydra_cfg.run_name = original
    path = Path(run_dir)
    return path.parent if path.name == sentinel else None


class ResolveLatestRun(Callback):
    """``run_name=latest``: the name of this recipe's newest run with a complete checkpoint
    (:func:`latest_run`), put in place before Hydra makes the run dir; one line and exit 2 without one."""

    def __init__(self) -> None:
        self.resolved: tuple[str, Path] | None = None

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        if config.get("run_name") != LATEST:
            return
        from omegaconf import open_dict, read_write

        root = outputs_root(config)
        if root is None and str(config.hydra.job.get("name", "")).startswith("train_ddp_process_"):
            return  # a rank Lightning's launcher started: its run dir is the launching process's
        if root is None:
            _exit(f"run_name={LATEST} needs hydra.run.dir to end with ${{run_name}} (it is {config.hydra.run.dir!r})")
        run = latest_run(root)
        if run is None:
            _exit(f"run_name={LATEST}: no run under {_shown(str(root))} has a complete checkpoint to resume; "
                  "start one without run_name=latest (or name a run: run_name=<name>)")
        name = run.relative_to(root).as_posix()
        with read_write(config), open_dict(config):
            config.run_name = name
        self.resolved = (name, run)

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        if self.resolved is not None:
            log.info("run_name=%s: resuming %s (run_name=%s)", LATEST, _shown(str(self.resolved[1])), self.resolved[0])


def _exit(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)
