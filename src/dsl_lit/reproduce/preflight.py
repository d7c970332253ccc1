"""Before any stage runs: every stage's command line (its wiring plus the preset's overrides) is
composed by Hydra and validated as its recipe would validate it, so a typo in
``reproduce.overrides.distill`` stops the run at start-up, not after the pretraining.

The commands are recorded, not run: a stage function is called with a context whose ``run``
keeps the argument list and stops the stage there. Checkpoints named by ``init_from`` do not exist
yet, so those arguments are left out (their architecture would replace the model group), and a
tokenizer an earlier stage's run directory will hold is composed as none (trained by the recipe).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra import compose
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from data_contract.errors import ConfigError
from dsl_lit.config.reproduce import ReproduceConfig
from dsl_lit.config.reproduce_stages import STAGE_ROWS
from dsl_lit.reproduce.runner import MARKER, Stage, StageContext, marker

PRETRAINING = ("pretrain.py",)
SWEEP = "scaling_laws.py"
FROM_CHECKPOINTS = ("hydra.run.dir=", "hydra.sweep.dir=", "init_from=", "teacher_from=", "teacher_samples=")
FROM_EARLIER_RUNS = ("data.tokenizer_dir=",)
"""Arguments naming what an earlier stage's run directory will hold, validated as null."""


class _Recorded(Exception):
    """Raised by the recording context once a stage has built its command."""


class RecordingContext(StageContext):
    """Keeps the commands a stage would run instead of running them."""

    def run_all(self, argvs: Sequence[Sequence[str]], concurrent: int = 1,
                log_paths: Sequence[Path] | None = None) -> None:
        self.commands.extend([*argv, *self.cfg.overrides.get(self.name, [])] for argv in argvs)
        raise _Recorded


def stage_commands(cfg: ReproduceConfig, stages: Sequence[Stage], run_dir: Path) -> dict[str, list[list[str]]]:
    """Each training stage's recipe commands (script, then arguments; several for the ablations'
    variants and seeds), wired as they would run now: the scaling stage's batch and lr from its
    marker when it has finished, else from the paper's laws."""
    from dsl_lit.reproduce.stages import pretraining_hparams

    finished = marker(run_dir / "scaling")
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        (root / "scaling").mkdir()
        results = finished["results"] if finished else pretraining_hparams({}, cfg)
        (root / "scaling" / MARKER).write_text(json.dumps({"results": results, "seconds": 0}, default=str))
        commands = {}
        for stage in stages:
            if not stage.row.trains:  # the pipeline, passkey, lm-eval, the report: no training config
                continue
            context = RecordingContext(cfg, root, stage.name)
            try:
                stage.run(context)
            except _Recorded:
                commands[stage.name] = context.commands
    return commands


def check_commands(cfg: ReproduceConfig, stages: Sequence[Stage], run_dir: Path) -> dict[str, Any]:
    """Compose and validate every training stage's commands; a one-line ConfigError naming the stage
    otherwise. Returns the validated ``TrainConfig`` of each stage's first command. Needs Hydra
    initialised with ``conf/`` (inside a recipe, or ``initialize_config_dir``)."""
    from dsl_lit.config.train import TrainConfig
    from dsl_lit.scaling.sweep import sweep_from_config

    configs: dict[str, Any] = {}
    for name, commands in stage_commands(cfg, stages, run_dir).items():
        for index, (script, *arguments) in enumerate(commands):
            overrides = [f"{a.split('=', 1)[0]}=null" if a.startswith(FROM_EARLIER_RUNS) else a
                         for a in arguments if not a.startswith(FROM_CHECKPOINTS)]
            run = f", run {index + 1} of {len(commands)}" if len(commands) > 1 else ""
            where = f"stage {name} (recipes/{Path(script).name} with reproduce.overrides.{name}{run})"
            try:
                composed = compose(Path(script).stem, overrides=overrides)
                if Path(script).name == SWEEP:  # a multirun: its sweep settings, then one point's training config
                    train = sweep_from_config(composed)[0].validate()
                else:
                    train = TrainConfig.from_hydra(composed, run_dir=str(run_dir / name),
                                                   post_training=Path(script).name not in PRETRAINING)
            except (HydraException, OmegaConfBaseException) as error:
                raise ConfigError(f"{where}: {str(error).splitlines()[0]}") from None
            except ConfigError as error:
                raise ConfigError(f"{where}: {error}") from None
            configs.setdefault(name, train)
    return configs


def check_device(cfg: ReproduceConfig) -> None:
    """A GPU preset on a machine whose torch sees no GPU stops at start-up, in one line (before,
    ``reproduce=gpu_small`` on a CPU ran until its first stage failed)."""
    if cfg.device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(f"reproduce={cfg.name} trains on a GPU (reproduce.device=cuda) and torch sees none here "
                          f"(torch {torch.__version__}): run it on a GPU machine, or use reproduce=cpu_mini")


def check_packages(cfg: ReproduceConfig, run_dir: Path) -> None:
    """A stage this machine cannot run stops the run at start-up: each unfinished stage of this run
    whose row ``requires`` a package that is missing (the data pipeline needs ``datasets``), unless
    its ``unless`` field is set (``reproduce.data_build`` feeds the stages without it). A missing
    lm-eval only skips the evaluation, saying so."""
    from dsl_lit.reproduce.stages import missing_module

    for row in STAGE_ROWS:
        chosen = cfg.stages is None or row.name in cfg.stages
        if not row.requires or not chosen or (row.unless and getattr(cfg, row.unless)) or marker(run_dir / row.name):
            continue
        for package in row.requires:
            missing = missing_module(package)
            if missing is not None:
                spare = f", or set reproduce.{row.unless} (what reproduce=gpu_short does)" if row.unless else ""
                raise ConfigError(f"stage {row.name} needs {package} ({missing}): install it{spare}")
