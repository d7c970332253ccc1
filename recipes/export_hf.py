"""Export a training checkpoint to a Hugging Face model directory.

    python recipes/export_hf.py checkpoint=outputs/pretrain/<run>/checkpoints/step-<N> output=hf/<name>
    python recipes/export_hf.py checkpoint=outputs/pretrain/<run> output=hf/<name> dtype=bf16  # latest step
    python recipes/export_hf.py checkpoint=... output=... weights=ema   # the run's EMA (memory.ema_decay > 0)
    python recipes/export_hf.py checkpoint=... output=... dtype=bf16 fp8=true  # DeepSeek-V3's FP8 release format

The output (config.json and generation_config.json with the tokenizer's bos/eos/pad ids, safetensors
weights, the run's tokenizer files) loads with ``transformers.AutoModelForCausalLM.from_pretrained(output)``
and ``AutoTokenizer``, without ``trust_remote_code``: DeepSeek LLM as ``LlamaForCausalLM``, DeepSeek-V3
as ``DeepseekV3ForCausalLM`` (with its MTP modules as the extra layers, as in the hub checkpoints) or,
softmax-routed, ``DeepseekV2ForCausalLM``. The model is rebuilt from the checkpoint's ``config.yaml``
(``dsl_lit.checkpoint.export_hf``); ``trainer_state.pt`` is opened (``weights_only=True``) only for ``weights=ema``.
Options and their defaults: ``conf/export_hf.yaml`` (``key=value`` as with Hydra, but parsed by
:func:`parse_args`).
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):  # groups and keys explained, before torch loads
    from dsl_lit.config.help import print_recipe_help

    print_recipe_help(__file__)

import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError

from dsl_lit.checkpoint.export_hf import export  # noqa: F401  (also this script's API: tests call export_hf.export)
from dsl_lit.config.errors import ConfigError

EXPORT_CONFIG = Path(__file__).resolve().parents[1] / "conf" / "export_hf.yaml"


def parse_args(argv: list[str]) -> DictConfig:
    """``key=value`` overrides of ``conf/export_hf.yaml``, Hydra's syntax (values parsed as YAML).

    Not ``@hydra.main``: Hydra would read ``checkpoint=...`` as a choice of the ``conf/checkpoint/``
    group, and an export needs no run directory. SystemExit with the usage for anything else.
    """
    cfg = OmegaConf.load(EXPORT_CONFIG)
    OmegaConf.set_struct(cfg, True)
    usage = f"usage: python recipes/export_hf.py checkpoint=<dir> output=<dir> [key=value ...]; keys: {list(cfg)}"
    if any(arg in ("-h", "--help") for arg in argv):
        from dsl_lit.config.help import print_recipe_help

        print_recipe_help(__file__, argv)
    bad = [arg for arg in argv if "=" not in arg or arg.startswith("-")]
    if bad:
        raise SystemExit(f"export_hf: error: {bad[0]!r} is not a key=value override\n{usage}")
    try:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(argv))
    except ConfigKeyError as error:
        raise SystemExit(f"export_hf: error: unknown key ({error.key!r})\n{usage}") from error
    for key in ("checkpoint", "output"):
        if OmegaConf.is_missing(cfg, key) or cfg[key] in (None, ""):
            raise SystemExit(f"export_hf: error: {key}=<dir> is required\n{usage}")
    return cfg


def main(argv: list[str] | None = None) -> Path:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return export(str(cfg.checkpoint), str(cfg.output), dtype=cfg.dtype, weights=cfg.weights,
                      max_shard_size=cfg.max_shard_size, overwrite=bool(cfg.overwrite), fp8=bool(cfg.fp8),
                      tokenizer_dir=str(cfg.tokenizer_dir) if cfg.tokenizer_dir else None)
    except (ConfigError, OSError) as error:  # a clear one-line error, not a traceback
        raise SystemExit(f"export_hf: error: {error}") from error


if __name__ == "__main__":
    main()
