"""Rejection sampling: k samples per prompt, keep the verified-correct ones, write an SFT dataset.

    python recipes/rejection_sample.py                                   # CPU demo (cold-start model)
    python recipes/rejection_sample.py init_from=outputs/grpo/<run> rejection.samples_per_prompt=16
    python recipes/sft.py sft.dataset=outputs/rejection_sample/<run>/samples.jsonl   # then SFT on it

Without ``init_from`` the model is first cold-started (``cold_start_steps`` of SFT, as in
recipes/grpo.py), so the demo has something to sample from. Sampling runs on every process of
``trainer.devices`` x ``trainer.num_nodes`` (each draws its share of the prompt batches; the output
is the same for any number), e.g. ``init_from=... trainer.devices=4``.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):  # groups and keys explained, before torch loads
    from dsl_lit.config.help import print_recipe_help

    print_recipe_help(__file__)

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from dsl_lit.posttrain.run import cold_start_sft, sample_to_file, setup_posttrain
from dsl_lit.training.runs import exits_on_config_error


@hydra.main(config_path="../conf", config_name="rejection_sample", version_base="1.3")
@exits_on_config_error
def main(hydra_cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    init_from = None
    if not hydra_cfg.get("init_from") and hydra_cfg.cold_start_steps:
        init_from = str(cold_start_sft(hydra_cfg, run_dir, hydra_cfg.cold_start_steps, hydra_cfg.cold_start_lr))
    setup = setup_posttrain(hydra_cfg, str(run_dir), init_from=init_from)
    sample_to_file(setup, run_dir / setup.post.rejection.output)


if __name__ == "__main__":
    main()
