"""Supervised fine-tuning (chat template, loss on the assistant's tokens, packing). Copy to adapt.

    python recipes/sft.py                                          # CPU demo: generated arithmetic task
    python recipes/sft.py init_from=outputs/pretrain/<run>         # from our pretraining checkpoint
    python recipes/sft.py init_from=hf/<dir> sft.dataset=data.jsonl sft.epochs=2
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

from dsl_lit.posttrain import SFTModule
from dsl_lit.posttrain.chat.conversations import encode_example, load_conversations
from dsl_lit.posttrain.chat.datamodule import RowsDataModule
from dsl_lit.posttrain.chat.rows import sft_rows
from dsl_lit.posttrain.run import fit, held_out_evaluation, module_kwargs, setup_posttrain, train_for_epochs
from dsl_lit.training.runs import exits_on_config_error


@hydra.main(config_path="../conf", config_name="sft", version_base="1.3")
@exits_on_config_error
def main(hydra_cfg: DictConfig) -> None:
    setup = setup_posttrain(hydra_cfg, HydraConfig.get().runtime.output_dir)
    cfg, post, tokenizer = setup.cfg, setup.post, setup.tokenizer
    L.seed_everything(cfg.trainer.seed, workers=True)

    examples = load_conversations(post.sft.dataset, post.task, post.sft.shortcut_share)
    conversations = [encode_example(tokenizer, e) for e in examples]  # chat through the template, plain text as is
    rows = sft_rows(conversations, cfg.data.seq_len, tokenizer.pad_id, post.sft.packing)
    train_for_epochs(setup, len(rows["input_ids"]))  # sft.epochs as trainer.max_steps, recorded
    datamodule = RowsDataModule(cfg.data, lambda: rows)
    fit(setup, SFTModule(**module_kwargs(setup), **held_out_evaluation(setup)), datamodule)


if __name__ == "__main__":
    main()
