"""Passkey retrieval of a checkpoint at several context lengths: what a context-extension stage buys.

    python recipes/passkey.py checkpoint=outputs/pretrain/cpu_context_128 lengths=[128,512]
    python recipes/passkey.py checkpoint=outputs/pretrain/cpu_context_128 \
        'rope_scaling={factor:16,original_max_seq_len:128,beta_fast:32,beta_slow:1,mscale:1,mscale_all_dim:1}'
    python recipes/passkey.py checkpoint=outputs/pretrain/cpu_context_2048

Prints a Markdown table (retrieval accuracy by length and key depth) and writes passkey.json to the
run directory (outputs/passkey/<time>/). Options and their defaults: conf/passkey.yaml.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):  # groups and keys explained, before torch loads
    from dsl_lit.config.help import print_recipe_help

    print_recipe_help(__file__)

import json
import logging
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from tokenizers import Tokenizer

from data_contract.format import TOKENIZER_FILE
from data_contract.schema import dataclass_from_dict
from dsl_lit.config.passkey import PasskeyConfig
from dsl_lit.evaluation.passkey import markdown_table, passkey_outcomes, shares, with_context
from dsl_lit.evaluation.source import load_eval_model
from dsl_lit.training.runs import exits_on_config_error

ConfigStore.instance().store(name="passkey", node=OmegaConf.load(Path(__file__).parents[1] / "conf" / "passkey.yaml"))
log = logging.getLogger(__name__)


@hydra.main(config_path=None, config_name="passkey", version_base="1.3")
@exits_on_config_error
def main(hydra_cfg: DictConfig) -> None:
    values = OmegaConf.to_container(hydra_cfg, resolve=True)
    values.pop("run_name", None)
    cfg = dataclass_from_dict(PasskeyConfig, values, "passkey").validate()
    source = load_eval_model(cfg.checkpoint, device=cfg.device, tokenizer_dir=cfg.tokenizer_dir)  # the run's, or refused
    model = with_context(source.model, max(max(cfg.lengths), source.model.config.max_seq_len), cfg.rope_scaling)
    tokenizer = Tokenizer.from_file(str(Path(source.tokenizer_dir) / TOKENIZER_FILE))
    outcomes = passkey_outcomes(model, tokenizer, cfg.lengths, cfg.depths, cfg.per_depth, cfg.seed, cfg.device)
    table = shares(outcomes)
    out = Path(HydraConfig.get().runtime.output_dir) / "passkey.json"
    result = {"checkpoint": source.info, "rope_scaling": model.config.rope_scaling,
              "accuracy": {str(n): {str(d): a for d, a in row.items()} for n, row in table.items()},
              "retrieved": {str(n): {str(d): [int(hit) for hit in hits] for d, hits in row.items()}
                            for n, row in outcomes.items()}}
    out.write_text(json.dumps(result, indent=2))
    print(markdown_table(table))
    log.info("wrote %s", out)


if __name__ == "__main__":
    main()
