"""Figures of a training run from its metrics.csv, for runs that never synced W&B.

    python recipes/report.py run=outputs/pretrain/<run>           # PNGs in outputs/pretrain/<run>/report/
    python recipes/report.py run=outputs/pretrain/<run> output=figures/

Draws loss and validation loss, learning rate, gradient norm, tokens/s and MFU, the MTP and
balance losses, a heatmap of expert load (max/mean per MoE layer) over time, and the downstream
evaluation metrics (eval/<task>/<metric>); each only when the run logged it.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):  # groups and keys explained, before torch loads
    from dsl_lit.config.help import print_recipe_help

    print_recipe_help(__file__)

import csv
from pathlib import Path

import hydra
import yaml
from omegaconf import DictConfig, OmegaConf

from data_contract.errors import ConfigError
from dsl_lit.report.figures import draw_report
from dsl_lit.report.metrics import METRICS_FILE, non_finite_steps
from dsl_lit.training.runs import exits_on_config_error


@hydra.main(config_path="../conf", config_name="report", version_base="1.3")
@exits_on_config_error
def main(cfg: DictConfig) -> list[Path]:
    if OmegaConf.is_missing(cfg, "run"):
        raise ConfigError("run= is required: python recipes/report.py run=outputs/pretrain/<run>")
    run = Path(str(cfg.run))
    if not (run / METRICS_FILE).is_file():
        raise ConfigError(f"run={cfg.run} holds no {METRICS_FILE}: {why_no_metrics(run)}")
    try:
        paths = draw_report(run, cfg.output)
    except csv.Error as error:
        raise ConfigError(f"run={cfg.run}: {METRICS_FILE} is not a CSV file we can read ({error})") from None
    for key, (bad, total) in sorted(non_finite_steps(run).items()):
        print(f"warning: {key} is NaN or inf at {bad} of its {total} steps (not drawn)"
              + (": the run diverged; see its log for the skipped steps" if key == "train/loss" else ""),
              file=sys.stderr)
    if not paths:
        raise ConfigError(f"run={cfg.run}: {METRICS_FILE} holds no step with a metric to draw (empty, non-finite, or "
                          "not a metrics file); nothing was written")
    for path in paths:
        print(path)
    return paths


def why_no_metrics(run: Path) -> str:
    """Why a directory has no metrics.csv: not there, not a run directory, a run made with
    ``logger.csv=false``, or a run that has not logged a step (yet)."""
    if not run.is_dir():
        return "no such directory"
    config = next((p for p in (run / "resolved_config.yaml", run / ".hydra" / "config.yaml") if p.is_file()), None)
    if config is None:
        return "it is not a run directory (no resolved_config.yaml); point run= at outputs/<recipe>/<run>"
    try:
        raw = yaml.safe_load(config.read_text())
        csv_on = (raw.get("logger") or {}).get("csv", True) if isinstance(raw, dict) else True
    except (yaml.YAMLError, AttributeError):
        csv_on = True
    if csv_on is False:
        return f"the run was made with logger.csv=false ({config.name}); its metrics are in W&B only"
    checkpoints = sorted((run / "checkpoints").glob("step-*")) if (run / "checkpoints").is_dir() else []
    return ("the run logged no metrics: it stopped, or is still starting, before its first logged step "
            "(the last step is always logged)" + (f"; it has {len(checkpoints)} checkpoint(s)" if checkpoints else ""))


if __name__ == "__main__":
    main()
