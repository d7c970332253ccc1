"""Reading and writing Hugging Face checkpoint directories (config.json + safetensors).

Family-agnostic: everything model-specific goes through an
:class:`~dsl_lit.models.common.hf_adapter.HFAdapter`, which the family registry supplies.
Weights are only ever read from safetensors (never unpickled), and ``trust_remote_code`` is never
needed: what we write loads with plain ``transformers.AutoModelForCausalLM.from_pretrained``.

Loading builds the model on the meta device, checks the checkpoint's names and shapes from the
safetensors headers, then allocates each tensor once, in the requested dtype and on the requested
device, and reads it straight into place (:class:`~dsl_lit.hf.reader.HFCheckpoint`: file by file,
one tensor at a time, so the checkpoint is never in memory as a whole; DeepSeek's quantised
releases, V3's block FP8 and V4's FP8 with FP4 experts, are dequantised block by block on the way).
``save_pretrained(..., fp8=True)`` writes the family's quantised release back
(:mod:`dsl_lit.hf.quantised`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from data_contract.errors import ConfigError
from data_contract.fs import follow_umask
from dsl_lit.hf.block_scaled import BlockScaled
from dsl_lit.hf.quantised import Quantisation
from dsl_lit.hf.reader import (
    CONFIG_NAME,
    SAFE_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    HFCheckpoint,
    check_state_dict,
)
from dsl_lit.models import ModelConfig, Transformer, build_model, family_spec
from dsl_lit.models.common.hf_adapter import TOKEN_ID_KEYS, HFAdapter, StateDict
from dsl_lit.models.registry import hf_reader
from dsl_lit.utils.materialise import (
    check_materialised,
    materialise,
    recompute_buffers,
    retie,
    tied_groups,
)

GENERATION_CONFIG_NAME = "generation_config.json"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")

DTypeLike = torch.dtype | str | None


# -- adapters --------------------------------------------------------------------------------------


def adapter_for_model_type(model_type: Any) -> HFAdapter:
    """The adapter reading checkpoints whose config.json has ``model_type`` (ConfigError if none)."""
    return hf_reader(model_type)


def adapter_for_family(family: str) -> HFAdapter:
    """The adapter writing models of ``family`` (ConfigError naming ``model.family`` if unknown)."""
    return family_spec(family).hf_adapter


# -- small helpers ---------------------------------------------------------------------------------


def parse_size(size: int | str) -> int:
    """Bytes from ``5GB`` (10**9, as HF reads it), ``500MiB`` (2**20), ``"1000"`` or an int."""
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*", size.upper())
        if match is None:
            raise ConfigError(f"max_shard_size={size!r} is not a size like '5GB', '500MiB' or a byte count")
        number, unit = float(match.group(1)), match.group(2) or "B"
        powers = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}
        base = 1024 if unit.endswith("IB") else 1000
        value = int(number * base ** powers[unit[0]])
    if value <= 0:
        raise ConfigError(f"max_shard_size={size!r} must be positive")
    return value


def resolve_dtype(dtype: DTypeLike, what: str = "dtype") -> torch.dtype | None:
    """``torch.bfloat16``, ``"bfloat16"``, ``"torch.bfloat16"`` or ``"bf16"`` -> a floating torch dtype."""
    if dtype is None or isinstance(dtype, torch.dtype):
        resolved = dtype
    else:
        name = dtype.removeprefix("torch.")
        name = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32"}.get(name, name)
        resolved = getattr(torch, name, None)
        if not isinstance(resolved, torch.dtype):
            raise ConfigError(f"{what}={dtype!r} is not a torch dtype (e.g. 'bfloat16', 'float32')")
    if resolved is not None and not resolved.is_floating_point:
        raise ConfigError(f"{what}={dtype!r} must be a floating-point dtype")
    return resolved


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# -- loading into our model ------------------------------------------------------------------------


def from_pretrained(
    path: str | Path,
    dtype: DTypeLike = None,
    attn_backend: str = "sdpa",
    device: torch.device | str = "cpu",
) -> tuple[Transformer, ModelConfig]:
    """Load a Hugging Face checkpoint directory into our model; returns ``(model, config)``.

    ``dtype`` None keeps the checkpoint's (``dtype``/``torch_dtype`` in config.json, else as stored;
    a block-FP8 weight dequantises to fp32 unless config.json names a dtype, bf16 in DeepSeek-V3's
    release). RoPE tables stay fp32 whatever ``dtype`` is, as transformers computes them, and so do
    the tensors the adapter keeps in fp32 (e.g. DeepSeek-V3's expert bias).
    """
    checkpoint = HFCheckpoint(path, attn_backend)
    target_dtype = resolve_dtype(dtype)
    if target_dtype is None:
        stored = checkpoint.hf_config.get("dtype") or checkpoint.hf_config.get("torch_dtype")
        if isinstance(stored, str) and stored != "auto":
            target_dtype = resolve_dtype(stored, what="config.json dtype")
    with torch.device("meta"):
        model = build_model(checkpoint.config)
    checkpoint.check(model.state_dict())
    targets = materialise(model, device, lambda name: checkpoint.dtype_for(name, target_dtype))
    checkpoint.fill(targets)
    return model, checkpoint.config


def load_into_meta_model(model: nn.Module, state: StateDict, device: torch.device, what: str) -> None:
    """Give a model built on the meta device the tensors of ``state`` (checked first, by name and
    shape), keeping tied weights tied and materialising the non-persistent buffers on ``device``."""
    check_state_dict(state, model.state_dict(), what=what)
    tied = tied_groups(model)
    model.load_state_dict(state, strict=True, assign=True)
    retie(model, tied)
    recompute_buffers(model, device)
    check_materialised(model)


# -- writing ---------------------------------------------------------------------------------------


def _plain_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
    if type(tensor).__name__ == "DTensor":
        raise ConfigError(
            f"parameter {name!r} is a sharded DTensor; gather a full state dict first (e.g. "
            "torch.distributed.checkpoint.state_dict.get_model_state_dict(..., full_state_dict=True)) "
            "and save from one rank"
        )
    return tensor.detach()


def _shard(names: list[str], sizes: dict[str, int], limit: int, scales: Collection[str] = ()) -> list[list[str]]:
    """Greedy, in order: start a new shard when the next tensor would push this one past ``limit``
    (a quantised weight's block ``scales``, each right after it, stay in its shard)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name in names:
        if shards[-1] and used + sizes[name] > limit and name not in scales:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += sizes[name]
    return shards


def _prepare(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """CPU, target dtype, contiguous, owning its storage (safetensors refuses shared/partial views)."""
    if dtype is not None and tensor.is_floating_point():
        tensor = tensor.to(dtype)
    tensor = tensor.to("cpu").contiguous()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


def _prepare_shard(
    hf_state: StateDict,
    names: list[str],
    dtype_of: Callable[[str], torch.dtype | None],
    quantised: Mapping[str, tuple[BlockScaled, str]] | None = None,
) -> StateDict:
    """:func:`_prepare` each tensor; a tensor stored under several names (e.g. DeepSeek-V3's MTP
    layer repeating the shared embedding) is copied, since one file may not hold shared storage.
    The weights ``quantised`` names (-> their format and their scales' name) are written in that
    format plus their scales (in the same file, as the releases do)."""
    quantised = quantised or {}
    scale_names = {scale for _, scale in quantised.values()}
    out: StateDict = {}
    seen: set[int] = set()
    for name in names:
        if name in scale_names:
            continue  # written with its weight
        if name in quantised:
            fmt, scale = quantised[name]
            values, scales = fmt.quantize(hf_state[name].detach().float())
            tensors = {name: _prepare(values, None), scale: _prepare(scales, None)}
        else:
            tensors = {name: _prepare(hf_state[name], dtype_of(name))}
        for key, tensor in tensors.items():
            if tensor.untyped_storage().data_ptr() in seen:
                tensor = tensor.clone()
            seen.add(tensor.untyped_storage().data_ptr())
            out[key] = tensor
    return out


def save_pretrained(
    model: nn.Module,
    path: str | Path,
    dtype: DTypeLike = None,
    max_shard_size: int | str = "5GB",
    fp8: bool = False,
) -> Path:
    """Write ``model`` as a Hugging Face checkpoint directory that ``AutoModelForCausalLM`` loads.

    ``dtype`` None keeps the model's dtype. Above ``max_shard_size`` the weights are split into
    ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``. Weight files from an
    earlier save into the same directory are removed so that no stale shard is picked up.
    ``fp8``: the family's quantised release (:mod:`dsl_lit.hf.quantised`): the weights its layout
    quantises (attention and MLP / expert projections) with amax scaling, each with its block
    scales, and ``quantization_config`` in config.json; the rest in ``dtype``. DeepSeek-V3's: FP8 in
    128x128 blocks, fp32 scales; DeepSeek-V4's: the same with ``float8_e8m0fnu`` power-of-two scales,
    the routed experts FP4 (``expert_dtype`` "fp4", 1x32 groups). Returns the directory.
    """
    model = getattr(model, "_orig_mod", model)  # torch.compile wrapper
    cfg = getattr(model, "config", None)
    if not isinstance(cfg, ModelConfig):
        raise ConfigError(
            f"save_pretrained needs a dsl_lit model with a ModelConfig .config, got {type(model)}"
        )
    adapter = adapter_for_family(cfg.family)
    target_dtype = resolve_dtype(dtype)
    limit = parse_size(max_shard_size)

    state = {name: _plain_tensor(name, t) for name, t in model.state_dict().items()}
    with torch.device("meta"):
        reference = build_model(cfg).state_dict()
    check_state_dict(state, reference, what="saving (the model must hold every layer, unsharded)")
    hf_state = adapter.to_hf(state, cfg)
    release = Quantisation.release_of(adapter) if fp8 else None
    quantised: dict[str, tuple[BlockScaled, str]] = {}  # quantised weight -> its format, its scales' name
    if release is not None:
        with_scales: StateDict = {}
        for name, tensor in hf_state.items():  # each scale right after its weight: one file holds both
            with_scales[name] = tensor
            fmt = release.written_as(adapter, name)
            if fmt is not None:
                quantised[name] = (fmt, adapter.scale_name(name))
                with_scales[adapter.scale_name(name)] = torch.empty(
                    fmt.scale_shape(tensor.shape), dtype=fmt.scale_dtype, device="meta")
        hf_state = with_scales

    # Tensors the adapter keeps in fp32 (as transformers does) are written fp32 whatever the dtype.
    # Quantised weights and their scales are written as their format stores them.
    scales = {scale for _, scale in quantised.values()}
    fp32 = {name for name in hf_state if adapter.keeps_fp32(name)}
    floating = [t.dtype for name, t in hf_state.items()
                if t.is_floating_point() and name not in fp32 and name not in quantised and name not in scales]
    written_dtype = target_dtype or (floating[0] if floating else torch.float32)
    if target_dtype is None and len(set(floating)) > 1:
        raise ConfigError(f"model mixes dtypes {sorted(map(str, set(floating)))}; pass dtype= to save in one")

    def dtype_of(name: str) -> torch.dtype | None:
        return torch.float32 if name in fp32 else target_dtype

    def nbytes(name: str, t: torch.Tensor) -> int:
        if name in quantised:  # one byte per FP8 value, per two FP4 values
            return math.prod(quantised[name][0].stored_shape(t.shape))
        if name in scales:
            return t.numel() * t.element_size()
        size = (dtype_of(name) or t.dtype).itemsize if t.is_floating_point() else t.element_size()
        return t.numel() * size

    sizes = {name: nbytes(name, t) for name, t in hf_state.items()}
    shards = _shard(list(hf_state), sizes, limit, scales)

    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.iterdir():
        if old.name in (SAFE_WEIGHTS_NAME, SAFE_INDEX_NAME) or _SHARD_RE.match(old.name):
            old.unlink()

    metadata = {"format": "pt"}  # transformers checks this key

    def write(names: list[str], fname: str) -> None:
        save_file(_prepare_shard(hf_state, names, dtype_of, quantised), str(directory / fname), metadata)
        follow_umask(directory / fname)  # save_file makes it -rw------- whatever the umask

    if len(shards) == 1:
        write(shards[0], SAFE_WEIGHTS_NAME)
    else:
        mapping: dict[str, str] = {}
        for i, names in enumerate(shards, start=1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            write(names, fname)
            mapping.update(dict.fromkeys(names, fname))
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": mapping}
        _write_json(directory / SAFE_INDEX_NAME, index)

    hf_config = adapter.config_to_hf(cfg)
    hf_config["dtype"] = dtype_name(written_dtype)  # transformers >= 4.56
    hf_config["torch_dtype"] = dtype_name(written_dtype)  # older transformers
    if release is not None:
        hf_config.update(release.hf_config())
    _write_json(directory / CONFIG_NAME, hf_config)
    generation = {"_from_model_config": True}
    generation.update({k: hf_config[k] for k in TOKEN_ID_KEYS if hf_config.get(k) is not None})
    _write_json(directory / GENERATION_CONFIG_NAME, generation)
    return directory
