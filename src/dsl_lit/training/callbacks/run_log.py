"""A run that says what it is doing, in its text log (``<run dir>/<recipe>.log`` and the terminal).

- every ``trainer.log_every_n_steps`` steps, one line: step/max_steps, loss, learning rate, tokens/s
  (over the steps since the previous line) and the time left at this session's pace;
- the last step always, also in the metrics loggers (``metrics.csv``): Lightning logs a row only
  every ``log_every_n_steps`` steps, so a run shorter than that, or whose last step falls between
  two rows, would end without its final values (a SIGTERM's last step alike);
- each validation, one line with its ``val/*`` results and the best validation loss so far;
- at the end of fit (:func:`closing_lines`, logged by ``dsl_lit.training.build.fit``): final loss,
  final and best validation loss, tokens seen, wall time, the checkpoint and the command that
  resumes the run.

Only global rank 0 writes; every rank reads the same (already synchronised) values, so no rank
waits on another here.
"""

from __future__ import annotations

import logging
import math
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L

log = logging.getLogger(__name__)


def duration(seconds: float) -> str:
    """``0:01:05`` (``h:mm:ss``, whole seconds)."""
    return str(timedelta(seconds=max(0, round(seconds))))


def _value(metrics: dict[str, Any], key: str) -> float | None:
    value = metrics.get(key)
    if value is None:
        return None
    return float(value.item() if hasattr(value, "item") else value)


class RunLog(L.Callback):
    """The step lines, the validation lines and the last-step row (module docstring). Kept last among
    the callbacks that log, so a line reads what this step logged."""

    def __init__(self) -> None:
        self.last_loss: tuple[int, float] | None = None
        """(step, train/loss) of the last line."""
        self.last_val: tuple[int, float] | None = None
        self.best_val: tuple[int, float] | None = None
        """(step, val/loss) of this session's last and best validation."""
        self.fit_start = 0.0
        self.start_step = 0
        self.start_tokens = 0
        self._first_step_end: tuple[float, int] | None = None
        self._window: tuple[float, int] = (0.0, 0)
        self._every: int | None = None

    @staticmethod
    def _tokens(pl_module: Any) -> int:
        return int(getattr(pl_module, "tokens_seen", 0) or 0)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.fit_start = time.monotonic()
        if hasattr(pl_module, "defer_step_logs"):
            pl_module.defer_step_logs = True  # handed to self.log here, on the steps Lightning writes

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if hasattr(pl_module, "defer_step_logs"):
            pl_module.defer_step_logs = False  # a later fit without RunLog logs every step again

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start_step, self.start_tokens = trainer.global_step, self._tokens(pl_module)
        self._first_step_end = None
        self._window = (time.monotonic(), self.start_tokens)
        if trainer.is_global_zero:
            start = "step 0" if not self.start_step else f"step {self.start_step} (resumed)"
            log.info("training from %s to %d (trainer.max_steps); a line every %d steps (trainer.log_every_n_steps)",
                     start, trainer.max_steps, trainer.log_every_n_steps)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        now, step = time.monotonic(), trainer.global_step
        if self._first_step_end is None:
            self._first_step_end = (now, step)
        last = trainer.max_steps > 0 and step >= trainer.max_steps
        if (last or trainer.received_sigterm) and trainer.log_every_n_steps not in (0, 1):
            # Lightning decides after this hook whether this step's metrics go to the loggers
            # (every log_every_n_steps): the last step's always do.
            self._every, trainer.log_every_n_steps = trainer.log_every_n_steps, 1
        written = trainer._logger_connector.should_update_logs
        if hasattr(pl_module, "flush_step_logs"):
            pl_module.flush_step_logs(written)  # the step's kept values (CausalLMModule.defer_step_logs)
        if not written:
            return
        metrics = trainer.callback_metrics
        loss, lr = _value(metrics, "train/loss"), _value(metrics, "train/lr")
        if loss is not None:
            self.last_loss = (step, loss)
        if not trainer.is_global_zero:
            return
        tokens = self._tokens(pl_module)
        seconds = now - self._window[0]
        rate = (tokens - self._window[1]) / seconds if seconds > 0 else math.nan
        self._window = (now, tokens)
        parts = [f"step {step}/{trainer.max_steps}"]
        if loss is not None:
            parts.append(f"loss {loss:.4f}")
        if lr is not None:
            parts.append(f"lr {lr:.3e}")
        index_kl, recall = _value(metrics, "train/index_kl"), _value(metrics, "train/index_recall")
        if index_kl is not None and recall is not None:  # DeepSeek-V3.2's indexer training
            parts.append(f"index KL {index_kl:.4f}, recall {recall:.3f}")
        if tokens and math.isfinite(rate):
            parts.append(f"{rate:,.0f} tokens/s")
        parts.append(f"{duration(now - self.fit_start)} elapsed" + ("" if last else f", ETA {self._eta(now, step, trainer)}"))
        log.info(" | ".join(parts))

    def _eta(self, now: float, step: int, trainer: L.Trainer) -> str:
        """Steps left at this session's pace since its first step (which carries start-up and compile)."""
        first_time, first_step = self._first_step_end or (self.fit_start, self.start_step)
        if step > first_step:
            per_step = (now - first_time) / (step - first_step)
        elif step > self.start_step:
            per_step = (now - self.fit_start) / (step - self.start_step)
        else:
            return "?"
        return duration(per_step * max(0, trainer.max_steps - step))

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        metrics = trainer.callback_metrics
        values = {k: _value(metrics, k) for k in sorted(metrics) if k.startswith("val/")}
        step, loss = trainer.global_step, values.get("val/loss")
        if loss is not None and math.isfinite(loss):
            self.last_val = (step, loss)
            if self.best_val is None or loss < self.best_val[1]:
                self.best_val = (step, loss)
        if not trainer.is_global_zero or not values:
            return
        shown = ", ".join(f"{k} {v:.4f}" for k, v in values.items() if v is not None)
        best = f" (best val/loss {self.best_val[1]:.4f} at step {self.best_val[0]})" if self.best_val else ""
        log.info("validation at step %d/%d: %s%s", step, trainer.max_steps, shown, best)

    def _restore_every(self, trainer: L.Trainer) -> None:
        if self._every is not None:
            trainer.log_every_n_steps, self._every = self._every, None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore_every(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore_every(trainer)


def _history(run_dir: str | Path) -> dict[str, Any]:
    """The run's whole record from its metrics.csv (every session of a resumed run), or {} without one."""
    from dsl_lit.training.metrics_file import read_metrics

    try:
        return read_metrics(Path(run_dir))
    except (OSError, ValueError):
        return {}


def closing_lines(trainer: L.Trainer, run_log: RunLog | None, run_dir: str | Path, checkpoint: str,
                  resume: str) -> list[str]:
    """The closing summary: where the run ended and in how long, its final loss, final and best
    validation loss (the whole run's, from metrics.csv when it has one; else this session's), tokens
    seen, the checkpoint (``checkpoint``: its path, or why there is none) and the command that
    resumes it (``resume``)."""
    module = trainer.lightning_module if trainer.lightning_module is not None else None
    step, max_steps = trainer.global_step, trainer.max_steps
    session = run_log or RunLog()
    seconds = time.monotonic() - session.fit_start if session.fit_start else 0.0
    tokens = RunLog._tokens(module)
    done = max_steps > 0 and step >= max_steps
    trained = step - session.start_step
    head = f"{'finished' if done else 'stopped'} at step {step}/{max_steps}"
    if trained > 0:
        rate = (tokens - session.start_tokens) / seconds if seconds > 0 else math.nan
        head += f": {trained} step(s) in {duration(seconds)}" + (
            f", {rate:,.0f} tokens/s" if tokens and math.isfinite(rate) else "")
    else:
        head += ": no step to train in this session (trainer.max_steps reached already)"
    lines = [head]
    history = _history(run_dir)

    def last(key: str) -> tuple[int, float] | None:
        series = history.get(key)
        return (int(series.steps[-1]) + 1, float(series.values[-1])) if series is not None and len(series.steps) else None

    loss = session.last_loss or last("train/loss")
    val_series = history.get("val/loss")
    if val_series is not None and len(val_series.steps):
        i = int(val_series.values.argmin())
        final_val, best_val = last("val/loss"), (int(val_series.steps[i]) + 1, float(val_series.values[i]))
    else:
        final_val, best_val = session.last_val, session.best_val
    parts = [f"final loss {loss[1]:.4f} (step {loss[0]})" if loss else "final loss: none logged"]
    if final_val and best_val:
        parts.append(f"val/loss {final_val[1]:.4f} (step {final_val[0]}), best {best_val[1]:.4f} (step {best_val[0]})")
    else:
        parts.append("no validation result (trainer.val_every_n_steps)")
    if tokens:
        parts.append(f"{tokens:,} tokens seen")
    lines.append("; ".join(parts))
    lines.append(f"checkpoint {checkpoint}")
    lines.append(f"to train on, raise trainer.max_steps in: {resume}" if done else f"resume: {resume}")
    return lines
