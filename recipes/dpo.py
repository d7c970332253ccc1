"""Direct Preference Optimization on (prompt, chosen, rejected) pairs. Copy to adapt.

    python recipes/dpo.py                                        # CPU demo: generated arithmetic pairs
    python recipes/dpo.py init_from=outputs/sft/<run>            # the usual start: an SFT checkpoint
    python recipes/dpo.py dpo.loss_type=ipo dpo.reference=model
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):  # groups and keys explained, before torch loads
    from dsl_lit.config.help import print_recipe_help

    print_recipe_help(__file__)

import hydra
import lightning as L
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from dsl_lit.posttrain import DPOModule
from dsl_lit.posttrain.chat.datamodule import RowsDataModule
from dsl_lit.posttrain.dpo.data import collate_pairs, load_pairs, preference_rows
from dsl_lit.posttrain.run import fit, module_kwargs, setup_posttrain
from dsl_lit.training.runs import exits_on_config_error


@hydra.main(config_path="../conf", config_name="dpo", version_base="1.3")
@exits_on_config_error
def main(hydra_cfg: DictConfig) -> None:
    setup = setup_posttrain(hydra_cfg, HydraConfig.get().runtime.output_dir)
    cfg, post = setup.cfg, setup.post
    L.seed_everything(cfg.trainer.seed, workers=True)
    pairs = load_pairs(post.dpo.dataset, post.task, post.dpo.num_pairs)
    rows = preference_rows(pairs, setup.tokenizer, cfg.data.seq_len)
    datamodule = RowsDataModule(cfg.data, lambda: rows, collate=collate_pairs)
    kwargs = module_kwargs(setup)
    kwargs["micro_batch_size"] = 2 * cfg.data.micro_batch_size  # rows: a chosen and a rejected per pair
    fit(setup, DPOModule(**kwargs, dpo=post.dpo), datamodule)


if __name__ == "__main__":
    main()
