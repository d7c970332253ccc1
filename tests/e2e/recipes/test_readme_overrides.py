"""Every pretraining command line the README shows composes and validates (the public CLI)."""

from __future__ import annotations

import re
import shlex

import pytest
from hydra import compose, initialize_config_dir

from dsl_lit.config import TrainConfig
from tests.conftest import ROOT, with_stage_inputs


def _readme_pretrain_commands() -> list[list[str]]:
    commands = []
    text = (ROOT / "README.md").read_text(encoding="utf-8").replace("\\\n", " ")  # continued lines
    for line in text.splitlines():
        match = re.match(r"\s*(?:\.venv/bin/)?python recipes/pretrain\.py(.*?)(?:\s+#.*)?$", line)
        if match:
            if "..." in match.group(1) or "<" in match.group(1):  # an illustration with placeholders
                continue
            args = shlex.split(match.group(1))
            if "-m" in args or "--cfg" in args:  # multirun / printing: composition is covered by the others
                continue
            commands.append([a for a in args if not a.startswith("hydra.")])
    return commands


COMMANDS = _readme_pretrain_commands()


def test_the_readme_shows_pretraining_commands():
    assert len(COMMANDS) >= 20, COMMANDS


@pytest.mark.parametrize("overrides", COMMANDS, ids=[" ".join(c) or "(defaults)" for c in COMMANDS])
def test_readme_command_validates(overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="pretrain", overrides=with_stage_inputs(overrides))
    train = TrainConfig.from_hydra(cfg, run_dir="unused")
    assert train.layout.dp * train.layout.cp * train.layout.tp * train.layout.pp == train.world_size
