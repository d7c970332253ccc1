"""Export a training checkpoint to a Hugging Face model directory.

    python recipes/export_hf.py checkpoint=outputs/pretrain/<run>[/checkpoints/step-<N>] output=hf/<name> dtype=bf16
    python recipes/export_hf.py checkpoint=... output=... weights=ema  # the EMA; dtype=bf16 fp8=true: the quantised release

The output (config.json, generation_config.json, safetensors, the run's tokenizer files; a run dir: its latest
step) loads with transformers' ``AutoModelForCausalLM``/``AutoTokenizer`` without ``trust_remote_code`` (DeepSeek
LLM as ``LlamaForCausalLM``, V3 as ``DeepseekV3ForCausalLM`` with its MTP layers, softmax-routed as V2's). Options:
``conf/export_hf.yaml`` (``key=value``, parsed by :func:`parse_args`); a bad one is one line, exit 2.
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

from data_contract.errors import ConfigError
from dsl_lit.checkpoint.export_hf import export  # noqa: F401  (also this script's API: tests call export_hf.export)

EXPORT_CONFIG = Path(__file__).resolve().parents[1] / "conf" / "export_hf.yaml"


class UsageError(SystemExit):
    """A bad input: its message (printed by ``__main__``), exit status 2, as every recipe's errors."""


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
        raise UsageError(f"export_hf: error: {bad[0]!r} is not a key=value override\n{usage}")
    try:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(argv))
    except ConfigKeyError as error:
        raise UsageError(f"export_hf: error: unknown key ({error.key!r})\n{usage}") from error
    for key in ("checkpoint", "output"):
        if OmegaConf.is_missing(cfg, key) or cfg[key] in (None, ""):
            raise UsageError(f"export_hf: error: {key}=<dir> is required\n{usage}")
    return cfg


def main(argv: list[str] | None = None) -> Path:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return export(str(cfg.checkpoint), str(cfg.output), dtype=cfg.dtype, weights=cfg.weights,
                      max_shard_size=cfg.max_shard_size, overwrite=bool(cfg.overwrite), fp8=bool(cfg.fp8),
                      tokenizer_dir=str(cfg.tokenizer_dir) if cfg.tokenizer_dir else None)
    except (ConfigError, OSError) as error:  # a clear one-line error, not a traceback
        raise UsageError(f"export_hf: error: {error}") from error


if __name__ == "__main__":
    try:
        main()
    except UsageError as error:
        print(error, file=sys.stderr)
        raise SystemExit(2) from None
