"""Running lm-evaluation-harness in process and keeping what it reports.

:class:`Harness` resolves the task directories once (the bundled tasks, then ``include_path``;
see :mod:`dsl_lit.evaluation.tasks`), checks the task names before any model is loaded, and runs
``lm_eval.simple_evaluate`` on an LM of ours. Results are written as lm-eval's command line
writes them (``results.json``: ``results``, ``groups``, ``configs``, ``versions``, ``n-shot``,
``higher-is-better``, ``n-samples``, ``config``, ...; samples one JSONL per task when logged) and
flattened to ``eval/<task>/<metric>`` scalars for the loggers.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from dsl_lit.config.eval import EvalTasksConfig
from dsl_lit.evaluation.bundled import BUNDLED_TASKS_DIR
from dsl_lit.evaluation.tasks import check_task_names, resolve_task_dirs

RESULTS_FILE = "results.json"


class Harness:
    """The tasks of ``cfg`` made loadable; :meth:`evaluate` runs them. A context manager: the
    resolved task directories live in a temporary directory until :meth:`close`."""

    def __init__(self, cfg: EvalTasksConfig) -> None:
        from lm_eval.tasks import TaskManager  # imported here: lm-eval takes seconds to import

        self.cfg = cfg
        self._work = tempfile.TemporaryDirectory(prefix="dsl_lit_tasks_")
        sources = [BUNDLED_TASKS_DIR, *cfg.include_paths]
        dirs = resolve_task_dirs(sources, Path(self._work.name))
        self.task_manager = TaskManager(include_path=[str(d) for d in dirs], include_defaults=cfg.include_defaults)
        where = ", ".join(map(str, sources)) + (" and lm-eval's task library" if cfg.include_defaults else "")
        check_task_names(cfg.tasks, self.task_manager.all_tasks, where)

    def evaluate(self, lm: Any) -> dict[str, Any] | None:
        """lm-eval's results on rank 0 (None on other ranks), seeded by ``cfg.seed``."""
        from lm_eval import simple_evaluate

        cfg = self.cfg
        limit = int(cfg.limit) if cfg.limit is not None and cfg.limit >= 1 else cfg.limit
        return simple_evaluate(
            model=lm, tasks=list(cfg.tasks), num_fewshot=cfg.num_fewshot, limit=limit, batch_size=cfg.batch_size,
            bootstrap_iters=cfg.bootstrap_iters, log_samples=cfg.log_samples, task_manager=self.task_manager,
            random_seed=cfg.seed, numpy_random_seed=cfg.seed, torch_random_seed=cfg.seed,
            fewshot_random_seed=cfg.seed,
        )

    def close(self) -> None:
        self._work.cleanup()

    def __enter__(self) -> Harness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_results(results: dict[str, Any], out_dir: str | Path) -> Path:
    """``results.json`` (and ``samples_<task>.jsonl`` when samples were logged) in ``out_dir``."""
    from lm_eval.utils import handle_non_serializable

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    aggregated = {k: v for k, v in results.items() if k != "samples"}
    path = out / RESULTS_FILE
    partial = out / f".{RESULTS_FILE}.tmp"  # then renamed: a kill mid-write leaves no truncated results.json
    partial.write_text(json.dumps(aggregated, indent=2, default=handle_non_serializable, ensure_ascii=False),
                       encoding="utf-8")
    os.replace(partial, path)
    for task, samples in (results.get("samples") or {}).items():
        lines = (json.dumps(s, default=handle_non_serializable, ensure_ascii=False) for s in samples)
        (out / f"samples_{task}.jsonl").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def flat_metrics(results: dict[str, Any], prefix: str = "eval") -> dict[str, float]:
    """``{"eval/<task>/<metric>": value}`` from lm-eval's ``results``; a metric under a named
    filter (lm-eval's ``"exact_match,first_number"``) becomes ``<metric>_<filter>``. Standard
    errors and non-numbers ("N/A" when not bootstrapped) are left out."""
    flat: dict[str, float] = {}
    for task, values in (results.get("results") or {}).items():
        for key, value in values.items():
            if "," not in key or "_stderr" in key or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            metric, filter_name = key.split(",", 1)
            name = metric if filter_name == "none" else f"{metric}_{filter_name}"
            if math.isfinite(value):
                flat[f"{prefix}/{task}/{name}"] = float(value)
    return flat
