"""Export a training checkpoint to a Hugging Face model directory.

    python recipes/export_hf.py checkpoint=outputs/pretrain/<run>/checkpoints/step-<N> output=hf/<name>
    python recipes/export_hf.py checkpoint=outputs/pretrain/<run> output=hf/<name> dtype=bf16  # latest step
    python recipes/export_hf.py checkpoint=... output=... weights=ema   # the run's EMA (memory.ema_decay > 0)

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
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError

from dsl_lit.checkpoint.files import CONFIG, META, SHARDS, STATE, checkpoint_problem
from dsl_lit.checkpoint.sharded import read_full_tensors
from dsl_lit.errors import ConfigError
from dsl_lit.hf import adapter_for_family, save_pretrained
from dsl_lit.hf.adapter import few
from dsl_lit.hf.io import load_into_meta_model, resolve_dtype, tied_groups
from dsl_lit.models import ModelConfig, Transformer, build_model
from dsl_lit.utils.fs import publish_dir

log = logging.getLogger(__name__)

WEIGHT_SOURCES = ("model", "ema")
PREFIX = "model."
"""The LightningModule holds the Transformer as ``self.model``: its state-dict keys carry this prefix."""
_FILES = (SHARDS, STATE, CONFIG, META)
_STEP_DIR = re.compile(r"step-\d+")

StateDict = dict[str, torch.Tensor]


# -- finding and reading the checkpoint ----------------------------------------------------------------


def find_checkpoint(path: str | Path) -> Path:
    """A ``step-<N>`` directory as it is, or the latest complete one of a run or checkpoints directory.

    FileNotFoundError says what is missing: a directory that is (or looks like) one checkpoint must
    hold shards/, trainer_state.pt, config.yaml and meta.json (written last, listing every file).
    """
    directory = Path(path)
    if not directory.exists():
        raise FileNotFoundError(f"checkpoint={path}: no such directory")
    if not directory.is_dir():
        raise NotADirectoryError(f"checkpoint={path} is a file; pass a checkpoints/step-<N> directory")
    if _STEP_DIR.fullmatch(directory.name) or any((directory / f).exists() for f in _FILES):
        problem = checkpoint_problem(directory)
        if problem is not None:
            raise FileNotFoundError(
                f"checkpoint={path} is not a complete checkpoint: {problem} (meta.json is written last, so "
                "this save was interrupted or is still running); pick another step"
            )
        return directory
    # Imported here: it imports Lightning (seconds), which exporting one step directory does not need.
    from dsl_lit.checkpoint.directory import latest_checkpoint

    root = directory / "checkpoints" if (directory / "checkpoints").is_dir() else directory
    latest = latest_checkpoint(root)
    if latest is None:
        raise FileNotFoundError(
            f"checkpoint={path} is not a checkpoint directory (checkpoints/step-<N>/ holding "
            f"{', '.join(_FILES)}) and holds no complete one under {root}"
        )
    log.info("checkpoint=%s: using its latest complete checkpoint %s", path, latest)
    return latest


def model_config(checkpoint: Path) -> ModelConfig:
    """The run's ``ModelConfig`` from the checkpoint's resolved ``config.yaml`` (its ``model`` group)."""
    path = checkpoint / "config.yaml"
    raw = yaml.safe_load(path.read_text())
    model = raw.get("model") if isinstance(raw, dict) else None
    if not isinstance(model, dict) or "name" not in model:
        raise ConfigError(f"{path} has no model group with a preset name (model.name); is it a run config?")
    values = dict(model)
    cfg = ModelConfig.from_name(values.pop("name"), **values)  # ConfigError naming a bad field
    adapter_for_family(cfg.family)  # ConfigError for a family without a Hugging Face layout
    return cfg


def read_model_weights(checkpoint: Path) -> StateDict:
    """The Transformer's tensors, whole, from the checkpoint's shards, LightningModule prefix stripped."""
    state = read_full_tensors(checkpoint / SHARDS, prefix="state_dict/")
    ours = {k.removeprefix(PREFIX): v for k, v in state.items() if k.startswith(PREFIX)}
    other = [k for k in state if not k.startswith(PREFIX)]
    if not ours:
        raise ConfigError(
            f"{checkpoint / SHARDS} holds no 'state_dict/{PREFIX}*' tensors (found {few(state)}); "
            "it is not a checkpoint of our LightningModules"
        )
    if other:
        log.warning("ignoring %d tensor(s) outside the model: %s", len(other), few(other))
    return ours


def read_ema(checkpoint: Path) -> tuple[StateDict, float]:
    """The EMA that ``dsl_lit.callbacks.ema.EMACallback`` saved, and its decay."""
    path = checkpoint / STATE
    state = torch.load(path, map_location="cpu", weights_only=True)  # weights_only: no code is unpickled
    callbacks: dict[str, Any] = state.get("callbacks") or {}
    found = [(k, v) for k, v in callbacks.items() if "EMACallback" in str(k) and isinstance(v, dict)]
    ema = read_full_tensors(checkpoint / SHARDS, prefix=f"callbacks/{found[0][0]}/ema/") if found else {}
    if not ema:
        raise ConfigError(
            f"weights=ema: {checkpoint} holds no EMA of the weights (the run had memory.ema_decay=0); "
            "use weights=model, or train with memory.ema_decay > 0"
        )
    return ema, float(found[0][1].get("decay", float("nan")))


def with_ema(state: StateDict, ema: StateDict, model: Transformer, keep_dtype: bool) -> StateDict:
    """``state`` with every parameter the EMA has replaced by its average. Buffers (the router's
    balancing bias) and parameters without an average stay as trained; tied names follow the EMA.
    ``keep_dtype``: cast the fp32 averages to the dtype the checkpoint stores the weights in."""
    unknown = sorted(set(ema) - set(state))
    if unknown:
        raise ConfigError(f"weights=ema: the EMA has tensor(s) the model has no parameter for: {few(unknown)}")
    out = dict(state)
    for name, average in ema.items():
        if average.shape != state[name].shape:
            raise ConfigError(
                f"weights=ema: EMA of {name} has shape {tuple(average.shape)}, the model's is "
                f"{tuple(state[name].shape)}"
            )
        out[name] = average.to(state[name].dtype) if keep_dtype else average
    for names in tied_groups(model):  # named_parameters() lists a tied tensor under one name only
        source = next((n for n in names if n in ema), None)
        if source is not None:
            out.update(dict.fromkeys(names, out[source]))
    params = [n for n, _ in model.named_parameters()]
    kept = [n for n in params if n not in ema]
    log.info("weights=ema: %d of %d parameters averaged", len(params) - len(kept), len(params))
    if kept:
        log.warning("weights=ema: %d parameter(s) have no EMA and keep their trained value: %s", len(kept), few(kept))
    return out


def load_checkpoint_model(
    checkpoint: str | Path, weights: str = "model", dtype: Any = None
) -> tuple[Transformer, dict[str, Any]]:
    """Our Transformer with a training checkpoint's weights, plus facts about them for logging.

    Built on the meta device and given the loaded tensors (``assign``), so no weight is allocated
    twice. ``dtype`` None keeps the checkpoint's dtype (the EMA's fp32 averages are cast to it).
    """
    if weights not in WEIGHT_SOURCES:
        raise ConfigError(f"weights={weights!r} is unknown; choose one of {WEIGHT_SOURCES}")
    target = resolve_dtype(dtype)
    directory = find_checkpoint(checkpoint)
    cfg = model_config(directory)
    with torch.device("meta"):
        model = build_model(cfg)
    state = read_model_weights(directory)
    info: dict[str, Any] = {"checkpoint": str(directory), "weights": weights, "family": cfg.family}
    info["global_step"] = json.loads((directory / "meta.json").read_text()).get("global_step")
    if weights == "ema":
        ema, info["ema_decay"] = read_ema(directory)
        state = with_ema(state, ema, model, keep_dtype=target is None)
    if target is not None:
        state = {k: v.to(target) if v.is_floating_point() else v for k, v in state.items()}
    load_into_meta_model(model, state, torch.device("cpu"), what=f"loading {directory / SHARDS}")
    return model.eval(), info


# -- writing -------------------------------------------------------------------------------------------


def export(
    checkpoint: str | Path,
    output: str | Path,
    dtype: Any = None,
    weights: str = "model",
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
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
        save_pretrained(model, tmp, dtype=dtype, max_shard_size=max_shard_size)
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


CONFIG = Path(__file__).resolve().parents[1] / "conf" / "export_hf.yaml"


def parse_args(argv: list[str]) -> DictConfig:
    """``key=value`` overrides of ``conf/export_hf.yaml``, Hydra's syntax (values parsed as YAML).

    Not ``@hydra.main``: Hydra would read ``checkpoint=...`` as a choice of the ``conf/checkpoint/``
    group, and an export needs no run directory. SystemExit with the usage for anything else.
    """
    cfg = OmegaConf.load(CONFIG)
    OmegaConf.set_struct(cfg, True)
    usage = f"usage: python recipes/export_hf.py checkpoint=<dir> output=<dir> [key=value ...]; keys: {list(cfg)}"
    if any(arg in ("-h", "--help") for arg in argv):
        print(__doc__.strip() + "\n\n" + usage + "\n\n" + CONFIG.read_text())
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
                      max_shard_size=cfg.max_shard_size, overwrite=bool(cfg.overwrite))
    except (ConfigError, OSError) as error:  # a clear one-line error, not a traceback
        raise SystemExit(f"export_hf: error: {error}") from error


if __name__ == "__main__":
    main()
