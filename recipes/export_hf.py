"""Export a training checkpoint to a Hugging Face model directory.

    python recipes/export_hf.py checkpoint=outputs/pretrain/<run>/checkpoints/step-<N> output=hf/<name>
    python recipes/export_hf.py checkpoint=outputs/pretrain/<run> output=hf/<name> dtype=bf16  # latest step
    python recipes/export_hf.py checkpoint=... output=... weights=ema   # the run's EMA (memory.ema_decay > 0)
    python recipes/export_hf.py checkpoint=... output=... dtype=bf16 fp8=true  # DeepSeek-V3's FP8 release format

The output (config.json, generation_config.json, safetensors weights) loads with
``transformers.AutoModelForCausalLM.from_pretrained(output)`` without ``trust_remote_code``: DeepSeek LLM
as ``LlamaForCausalLM``, DeepSeek-V3 as ``DeepseekV3ForCausalLM`` (with its MTP modules as the extra
layers, as in the hub checkpoints) or, softmax-routed, ``DeepseekV2ForCausalLM``. The model is rebuilt
from the checkpoint's ``config.yaml`` and written by ``dsl_lit.hf.save_pretrained``. Weights are read
from the checkpoint's safetensors shards (assembled whatever layout wrote them); ``trainer_state.pt``
is opened (``weights_only=True``) only for ``weights=ema``. The output directory appears only once complete. Options and their defaults:
``conf/export_hf.yaml`` (``key=value`` as with Hydra, but parsed by :func:`parse_args`).
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError

from dsl_lit.checkpoint.reader import WEIGHT_SOURCES, find_checkpoint, load_checkpoint_model
from dsl_lit.config.errors import ConfigError
from dsl_lit.hf import save_pretrained
from dsl_lit.hf.io import resolve_dtype
from dsl_lit.utils.fs import publish_dir

log = logging.getLogger(__name__)


# -- writing -------------------------------------------------------------------------------------------


def export(
    checkpoint: str | Path,
    output: str | Path,
    dtype: Any = None,
    weights: str = "model",
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    fp8: bool = False,
) -> Path:
    """Write ``checkpoint`` as a Hugging Face model directory at ``output``; returns it.

    The directory is written beside ``output`` and renamed into place once complete. An existing
    non-empty ``output`` is replaced only with ``overwrite``.
    """
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"output={output} is a file")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"output={output} exists and is not empty; pass overwrite=true to replace it")
    if weights not in WEIGHT_SOURCES:  # before any reading
        raise ConfigError(f"weights={weights!r} is unknown; choose one of {WEIGHT_SOURCES}")
    resolve_dtype(dtype)
    directory = find_checkpoint(checkpoint)
    if directory.resolve().is_relative_to(out.resolve()):
        raise ConfigError(f"output={output} would replace the checkpoint {directory}; write elsewhere")

    model, info = load_checkpoint_model(directory, weights=weights, dtype=dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        save_pretrained(model, tmp, dtype=dtype, max_shard_size=max_shard_size, fp8=fp8)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_dir(tmp, out)
    hf_config = json.loads((out / "config.json").read_text())
    log.info(
        "exported %s (step %s, weights=%s) to %s as %s, dtype %s",
        info["checkpoint"], info["global_step"], weights, out, hf_config["architectures"][0], hf_config["dtype"],
    )
    return out


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
        print(__doc__.strip() + "\n\n" + usage + "\n\n" + EXPORT_CONFIG.read_text())
        raise SystemExit(0)
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
                      max_shard_size=cfg.max_shard_size, overwrite=bool(cfg.overwrite), fp8=bool(cfg.fp8))
    except (ConfigError, OSError) as error:  # a clear one-line error, not a traceback
        raise SystemExit(f"export_hf: error: {error}") from error


if __name__ == "__main__":
    main()
