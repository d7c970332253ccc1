"""The OmegaConf resolvers our YAML uses, registered by an explicit call (never as an import side
effect): every recipe's start (``training.runs.exits_on_config_error``) and ``TrainConfig.from_hydra``
call :func:`register_resolvers` before anything is resolved."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

PROJECT_ROOT = Path(__file__).resolve().parents[3]
"""The checkout: where the bundled corpus, the evaluation tasks and the default data cache live."""


def register_resolvers() -> None:
    """``${project_root:}``: :data:`PROJECT_ROOT`, wherever the command runs from. Idempotent."""
    if not OmegaConf.has_resolver("project_root"):
        OmegaConf.register_new_resolver("project_root", lambda: str(PROJECT_ROOT))
