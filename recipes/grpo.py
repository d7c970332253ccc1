"""GRPO with rule-based rewards (DeepSeek-R1's reasoning RL). Copy to adapt.

    python recipes/grpo.py                                  # CPU demo: cold-start SFT, then GRPO on task=largest
    python recipes/grpo.py init_from=outputs/sft/<run>      # skip the cold start: start from a checkpoint
    python recipes/grpo.py grpo.group_size=16 grpo.iterations=2 grpo.loss_type=dapo grpo.rewards.language=0.1

Without ``init_from``, R1's cold start runs first: ``grpo.cold_start_steps`` of SFT on the task's
reference replies in ``<run dir>/cold_start`` (a run of its own, resumable), and GRPO starts from
its last checkpoint. A rerun of the same run dir resumes GRPO from its latest checkpoint.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):  # groups and keys explained, before torch loads
    from dsl_lit.config.help import print_recipe_help

    print_recipe_help(__file__)

import logging
from pathlib import Path

import hydra
import lightning as L
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from dsl_lit.checkpoint.directory import latest_checkpoint
from dsl_lit.posttrain import GRPOModule
from dsl_lit.posttrain.chat.datamodule import RowsDataModule
from dsl_lit.posttrain.grpo.data import prompt_rows, read_problems
from dsl_lit.posttrain.rewards import build_rewards
from dsl_lit.posttrain.run import cold_start_sft, fit, held_out_evaluation, module_kwargs, setup_posttrain
from dsl_lit.tasks import arithmetic
from dsl_lit.training.runs import exits_on_config_error

log = logging.getLogger(__name__)


@hydra.main(config_path="../conf", config_name="grpo", version_base="1.3")
@exits_on_config_error
def main(hydra_cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    init_from = None
    resuming = latest_checkpoint(run_dir / "checkpoints") is not None
    if not hydra_cfg.get("init_from") and hydra_cfg.grpo.cold_start_steps and not resuming:
        grpo = hydra_cfg.grpo
        init_from = str(cold_start_sft(hydra_cfg, run_dir, grpo.cold_start_steps, grpo.cold_start_lr, grpo.cold_start_shortcut))
    setup = setup_posttrain(hydra_cfg, str(run_dir), init_from=init_from)
    cfg, post, tokenizer = setup.cfg, setup.post, setup.tokenizer
    L.seed_everything(cfg.trainer.seed, workers=True)

    own = post.grpo.dataset != "task"  # a prompts file: its problems, no held-out task evaluation
    train = read_problems(post.grpo.dataset) if own else arithmetic.split(post.task)[0]
    datamodule = RowsDataModule(cfg.data, lambda: prompt_rows(train, tokenizer))
    datamodule.steps_per_batch = post.grpo.iterations
    kwargs = module_kwargs(setup)
    kwargs["micro_batch_size"] = cfg.data.micro_batch_size * post.grpo.group_size  # completions
    evaluation = {"eval_set": ()} if own else held_out_evaluation(setup)
    module = GRPOModule(**kwargs, grpo=post.grpo, rewards=build_rewards(post.grpo.rewards), problems=train,
                        tokenizer=tokenizer, eval_set=evaluation["eval_set"], seed=cfg.trainer.seed)
    fit(setup, module, datamodule)


if __name__ == "__main__":
    main()
