"""Third-party messages that tell our users nothing, silenced in one place, each by its own text.

Every entry is matched by the start of its message (never a whole category or module), so a new or
different warning from the same library still shows. :func:`silence_known_noise` installs them; the
trainer builder calls it (``dsl_lit.training.build.build_trainer``), before Lightning or W&B speak.

- Lightning's ``ModelCheckpoint`` warns "Checkpoint directory ... exists and is not empty" on every
  resume: resuming from that directory is the point, and our step directories are never overwritten
  by another run's (each run has its own run dir).
- Lightning warns that checkpoints under manual optimization hold the weights after the step: that is
  what we save and resume from.
- Lightning's pytree helper builds a ``LeafSpec``, which torch now deprecates
  ("`isinstance(treespec, LeafSpec)` is deprecated"): Lightning's to fix, nothing a user can act on.
- torch's DeviceMesh warns, in every rank of a multi-process run, that slicing a flattened dimension
  from the root mesh "will be deprecated in PT 2.11": our strategy's mesh does that today; a note for
  whoever upgrades torch, not for a user.
- Lightning's "Tip: ... try installing litlogger" advertisement (a log record, not a warning).
- W&B's "The anonymous setting has no effect" is avoided where it starts (Lightning's ``WandbLogger``
  passes ``anonymous=None``): :func:`quiet_wandb_logger`.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

KNOWN_HARMLESS_WARNINGS: tuple[tuple[str, str], ...] = (
    (r"Checkpoint directory .* exists and is not empty", "Lightning's ModelCheckpoint, on every resume"),
    (r".*ModelCheckpoint with manual optimization", "Lightning: manual-optimization checkpoints hold post-step weights"),
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", "torch's deprecation, raised inside Lightning's pytree helper"),
    (r"Slicing a flattened dim from root mesh will be deprecated", "torch's DeviceMesh (2.10), once per rank of a "
     "multi-process run: our strategy slices its flattened data-parallel dims (revisit before torch 2.11)"),
)
"""(regular expression matched against the start of the warning's message, where it comes from)."""

KNOWN_HARMLESS_LOG_RECORDS: tuple[tuple[str, str], ...] = (
    ("💡 Tip: For seamless cloud logging", "Lightning's litlogger advertisement, once per Trainer"),
)
"""(start of the log record's message, where it comes from): Lightning's rank-zero loggers."""

_LIGHTNING_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


class _DropKnownRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(message.startswith(start) for start, _ in KNOWN_HARMLESS_LOG_RECORDS)


def silence_known_noise() -> None:
    """Install the filters above (idempotent: Python replaces an identical warnings filter, and the
    log filter is added once)."""
    for message, _ in KNOWN_HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    for name in _LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnownRecords) for f in logger.filters):
            logger.addFilter(_DropKnownRecords())


def quiet_wandb_logger(logger: Any) -> Any:
    """``logger`` (Lightning's ``WandbLogger``) without the ``anonymous=None`` it passes to
    ``wandb.init``, which makes W&B print "The anonymous setting has no effect" (any value but
    unset does); returns it."""
    init = getattr(logger, "_wandb_init", None)
    if isinstance(init, dict) and init.get("anonymous") is None:
        init.pop("anonymous", None)
    return logger
