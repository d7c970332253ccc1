"""Distillation, R1-Distill style: a teacher samples (verified by the rule rewards unless
``rejection.verify=false``), then a smaller student is SFT-ed on those samples. Copy to adapt.

    python recipes/distill.py                                    # CPU demo: cold-started teacher, 1-layer student
    python recipes/distill.py teacher_from=outputs/grpo/<run> student.n_layers=2   # init_from: the student's start

    python recipes/distill.py teacher_samples=outputs/rejection_sample/<run>/samples.jsonl student.n_layers=2

Stages, each in the run dir: ``teacher/`` (only without ``teacher_from``: a cold-start SFT of the
``model`` group), ``distill_data.jsonl`` (the teacher's kept samples), then the student's SFT run
(``model`` with the ``student`` overrides, or ``init_from``'s weights) with its checkpoints. With
``teacher_samples`` the student learns from that file and nothing is sampled (R1 distils its students
from the same 800K curated samples its own second SFT uses).
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):  # groups and keys explained, before torch loads
    from dsl_lit.config.help import print_recipe_help

    print_recipe_help(__file__)

from pathlib import Path

import hydra
import lightning as L
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from data_contract.errors import ConfigError
from dsl_lit.posttrain import SFTModule
from dsl_lit.posttrain.chat.conversations import read_conversations
from dsl_lit.posttrain.chat.datamodule import RowsDataModule
from dsl_lit.posttrain.chat.rows import sft_rows
from dsl_lit.posttrain.run import (
    cold_start_sft,
    fit,
    held_out_evaluation,
    module_kwargs,
    sample_to_file,
    setup_posttrain,
)
from dsl_lit.training.runs import exits_on_config_error


@hydra.main(config_path="../conf", config_name="distill", version_base="1.3")
@exits_on_config_error
def main(hydra_cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    data = run_dir / "distill_data.jsonl"
    given = hydra_cfg.get("teacher_samples")
    if given:  # samples drawn and verified already (recipes/rejection_sample.py): R1 distils from that same data
        if hydra_cfg.get("teacher_from"):
            raise ConfigError(f"teacher_samples={given} and teacher_from={hydra_cfg.teacher_from}: give one (the "
                              "samples to learn from, or the teacher to draw them from)")
        data = Path(given)
        if not data.is_file():
            raise ConfigError(f"teacher_samples={given}: no such file (write it with recipes/rejection_sample.py, "
                              "or set teacher_samples=null to sample a teacher)")
        read_conversations(data)  # an empty or malformed one refused now, naming it, before the student is built
    elif not data.is_file():  # a rerun resumes the student's SFT with the same data
        teacher = hydra_cfg.get("teacher_from")
        if not teacher:
            teacher = str(cold_start_sft(hydra_cfg, run_dir / "teacher", hydra_cfg.teacher_cold_start_steps,
                                         hydra_cfg.teacher_cold_start_lr))
        teacher_setup = setup_posttrain(hydra_cfg, str(run_dir / "teacher"), init_from=teacher)
        summary = sample_to_file(teacher_setup, data)
        if not summary["kept"]:
            raise ConfigError(f"the teacher {teacher} produced no accepted sample; train it longer, lower "
                              "rejection.min_reward or set rejection.verify=false")

    student_cfg = OmegaConf.merge(hydra_cfg, {"model": OmegaConf.to_container(hydra_cfg.student)})
    setup = setup_posttrain(student_cfg, str(run_dir))
    L.seed_everything(setup.cfg.trainer.seed, workers=True)
    conversations = [setup.tokenizer.encode_conversation(c) for c in read_conversations(data)]
    rows = sft_rows(conversations, setup.cfg.data.seq_len, setup.tokenizer.pad_id, setup.post.sft.packing)
    fit(setup, SFTModule(**module_kwargs(setup), **held_out_evaluation(setup)), RowsDataModule(setup.cfg.data, lambda: rows))


if __name__ == "__main__":
    main()
