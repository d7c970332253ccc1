"""Reading and writing Hugging Face checkpoint directories (config.json + safetensors).

Family-agnostic: everything model-specific goes through an
:class:`~dsl_lit.models.common.hf_adapter.HFAdapter`, which the family registry supplies.
Weights are only ever read from safetensors (never unpickled), and ``trust_remote_code`` is never
needed: what we write loads with plain ``transformers.AutoModelForCausalLM.from_pretrained``.

Loading builds the model on the meta device and hands the loaded tensors to
``load_state_dict(assign=True)``, so the weights are allocated once, in the requested dtype and on
the requested device; only the non-persistent buffers (RoPE tables) are then materialised.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from dsl_lit.config.errors import ConfigError
from dsl_lit.models import ModelConfig, Transformer, build_model, family_spec
from dsl_lit.models.common.hf_adapter import TOKEN_ID_KEYS, HFAdapter, StateDict, few
from dsl_lit.models.registry import hf_reader
from dsl_lit.utils.fs import follow_umask

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_INDEX_NAME = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_PICKLE_PATTERNS = ("pytorch_model*.bin", "*.bin", "*.pt", "*.pth", "*.ckpt")

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


def _read_json(path: Path) -> dict[str, Any]:
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return data


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# -- reading weights -------------------------------------------------------------------------------


def weight_map(directory: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file holding it, from a single file or a sharded index."""
    single = directory / SAFE_WEIGHTS_NAME
    index = directory / SAFE_INDEX_NAME
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    if index.is_file():
        mapping = _read_json(index).get("weight_map")
        if not isinstance(mapping, dict) or not mapping:
            raise ConfigError(f"{index} has no 'weight_map'")
        files = {name: directory / fname for name, fname in mapping.items()}
        absent = sorted({str(p.name) for p in files.values() if not p.is_file()})
        if absent:
            raise FileNotFoundError(f"{index} names shard(s) that are not in {directory}: {few(absent)}")
        return files
    pickles = sorted({p.name for pattern in _PICKLE_PATTERNS for p in directory.glob(pattern)})
    if pickles:
        raise ConfigError(
            f"{directory} has only pickled weights ({few(pickles)}); dsl_lit reads safetensors only and "
            "never unpickles checkpoints. Convert them to safetensors with a tool you trust first"
        )
    raise FileNotFoundError(f"{directory} has neither {SAFE_WEIGHTS_NAME} nor {SAFE_INDEX_NAME}")


def read_safetensors(
    files: dict[str, Path],
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    keep_fp32: Callable[[str], bool] | None = None,
) -> StateDict:
    """Load the named tensors, casting floating ones to ``dtype`` one at a time (bounded peak memory);
    names for which ``keep_fp32`` is true are read as fp32 whatever ``dtype`` is."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    out: StateDict = {}
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            present = set(f.keys())
            lost = [n for n in names if n not in present]
            if lost:
                raise ConfigError(f"{path.name} lacks tensor(s) its index assigns to it: {few(lost)}")
            for name in names:
                tensor = f.get_tensor(name)
                want = torch.float32 if keep_fp32 is not None and keep_fp32(name) else dtype
                if want is not None and tensor.is_floating_point() and tensor.dtype != want:
                    tensor = tensor.to(want)
                out[name] = tensor
    return out


# -- loading into our model ------------------------------------------------------------------------


def tied_groups(model: nn.Module) -> list[list[str]]:
    """Names of parameters that are one shared tensor (e.g. a tied output head and embedding)."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _retie(model: nn.Module, groups: Iterable[list[str]]) -> None:
    """``load_state_dict(assign=True)`` gives each name its own Parameter; share them again."""
    for names in groups:
        shared = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, shared)


def _materialise_buffers(model: nn.Module, device: torch.device) -> None:
    """Allocate buffers still on meta (non-persistent, so not in any checkpoint) and recompute them."""
    for name, module in model.named_modules():
        if not any(b.is_meta for b in module.buffers(recurse=False)):
            continue
        if any(True for _ in module.parameters(recurse=False)) or not hasattr(module, "reset_parameters"):
            raise RuntimeError(
                f"module {name or type(module).__name__!r} has meta buffers that cannot be recomputed "
                "in isolation (it owns parameters or has no reset_parameters)"
            )
        module.to_empty(device=device, recurse=False)
        module.reset_parameters()
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"tensors left on the meta device after loading: {few(left)}")


def check_state_dict(state: StateDict, expected: dict[str, torch.Tensor], what: str) -> None:
    """ConfigError listing missing / unexpected names and shape mismatches against ``expected``."""
    missing = set(expected) - set(state)
    unexpected = set(state) - set(expected)
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} weight(s): {few(missing)}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)} weight(s): {few(unexpected)}")
    wrong = [
        f"{n} {tuple(state[n].shape)} != {tuple(expected[n].shape)}"
        for n in sorted(set(state) & set(expected))
        if state[n].shape != expected[n].shape
    ]
    if wrong:
        problems.append(f"{len(wrong)} shape mismatch(es) (got != expected): {', '.join(wrong[:5])}")
    if problems:
        raise ConfigError(f"{what}: " + "; ".join(problems))


def from_pretrained(
    path: str | Path,
    dtype: DTypeLike = None,
    attn_backend: str = "sdpa",
    device: torch.device | str = "cpu",
) -> tuple[Transformer, ModelConfig]:
    """Load a Hugging Face checkpoint directory into our model; returns ``(model, config)``.

    ``dtype`` None keeps the checkpoint's (``dtype``/``torch_dtype`` in config.json, else as stored).
    RoPE tables stay fp32 whatever ``dtype`` is, as transformers computes them, and so do the
    tensors the adapter keeps in fp32 (e.g. DeepSeek-V3's expert bias).
    """
    directory = Path(path)
    if not (directory / CONFIG_NAME).is_file():
        raise FileNotFoundError(f"{directory} is not a Hugging Face checkpoint directory (no {CONFIG_NAME})")
    hf_config = _read_json(directory / CONFIG_NAME)
    adapter = adapter_for_model_type(hf_config.get("model_type"))
    files = weight_map(directory)
    cfg = adapter.config_for_checkpoint(adapter.config_from_hf(hf_config), files.keys())
    cfg.name = directory.resolve().name
    cfg.attn_backend = attn_backend  # type: ignore[assignment]
    cfg.validate()

    target_dtype = resolve_dtype(dtype)
    if target_dtype is None:
        stored = hf_config.get("dtype") or hf_config.get("torch_dtype")
        if isinstance(stored, str) and stored != "auto":
            target_dtype = resolve_dtype(stored, what="config.json dtype")

    with torch.device("meta"):
        model = build_model(cfg)
    hf_state = read_safetensors(files, dtype=target_dtype, device=device, keep_fp32=adapter.keeps_fp32)
    state = adapter.from_hf(hf_state, cfg)
    del hf_state
    load_into_meta_model(model, state, torch.device(device), what=f"loading {directory}")
    return model, cfg


def load_into_meta_model(model: nn.Module, state: StateDict, device: torch.device, what: str) -> None:
    """Give a model built on the meta device the tensors of ``state`` (checked first, by name and
    shape), keeping tied weights tied and materialising the non-persistent buffers on ``device``."""
    check_state_dict(state, model.state_dict(), what=what)
    tied = tied_groups(model)
    model.load_state_dict(state, strict=True, assign=True)
    _retie(model, tied)
    _materialise_buffers(model, device)


# -- writing ---------------------------------------------------------------------------------------


def _plain_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
    if type(tensor).__name__ == "DTensor":
        raise ConfigError(
            f"parameter {name!r} is a sharded DTensor; gather a full state dict first (e.g. "
            "torch.distributed.checkpoint.state_dict.get_model_state_dict(..., full_state_dict=True)) "
            "and save from one rank"
        )
    return tensor.detach()


def _shard(names: list[str], sizes: dict[str, int], limit: int) -> list[list[str]]:
    """Greedy, in order: start a new shard when the next tensor would push this one past ``limit``."""
    shards: list[list[str]] = [[]]
    used = 0
    for name in names:
        if shards[-1] and used + sizes[name] > limit:
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
    hf_state: StateDict, names: list[str], dtype_of: Callable[[str], torch.dtype | None]
) -> StateDict:
    """:func:`_prepare` each tensor; a tensor stored under several names (e.g. DeepSeek-V3's MTP
    layer repeating the shared embedding) is copied, since one file may not hold shared storage."""
    out: StateDict = {}
    seen: set[int] = set()
    for name in names:
        tensor = _prepare(hf_state[name], dtype_of(name))
        if tensor.untyped_storage().data_ptr() in seen:
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        out[name] = tensor
    return out


def save_pretrained(
    model: nn.Module,
    path: str | Path,
    dtype: DTypeLike = None,
    max_shard_size: int | str = "5GB",
) -> Path:
    """Write ``model`` as a Hugging Face checkpoint directory that ``AutoModelForCausalLM`` loads.

    ``dtype`` None keeps the model's dtype. Above ``max_shard_size`` the weights are split into
    ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``. Weight files from an
    earlier save into the same directory are removed so that no stale shard is picked up.
    Returns the directory.
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

    # Tensors the adapter keeps in fp32 (as transformers does) are written fp32 whatever the dtype.
    fp32 = {name for name in hf_state if adapter.keeps_fp32(name)}
    floating = [t.dtype for name, t in hf_state.items() if t.is_floating_point() and name not in fp32]
    written_dtype = target_dtype or (floating[0] if floating else torch.float32)
    if target_dtype is None and len(set(floating)) > 1:
        raise ConfigError(f"model mixes dtypes {sorted(map(str, set(floating)))}; pass dtype= to save in one")

    def dtype_of(name: str) -> torch.dtype | None:
        return torch.float32 if name in fp32 else target_dtype

    def nbytes(name: str, t: torch.Tensor) -> int:
        size = (dtype_of(name) or t.dtype).itemsize if t.is_floating_point() else t.element_size()
        return t.numel() * size

    sizes = {name: nbytes(name, t) for name, t in hf_state.items()}
    shards = _shard(list(hf_state), sizes, limit)

    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.iterdir():
        if old.name in (SAFE_WEIGHTS_NAME, SAFE_INDEX_NAME) or _SHARD_RE.match(old.name):
            old.unlink()

    metadata = {"format": "pt"}  # transformers checks this key

    def write(names: list[str], fname: str) -> None:
        save_file(_prepare_shard(hf_state, names, dtype_of), str(directory / fname), metadata)
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
    _write_json(directory / CONFIG_NAME, hf_config)
    generation = {"_from_model_config": True}
    generation.update({k: hf_config[k] for k in TOKEN_ID_KEYS if hf_config.get(k) is not None})
    _write_json(directory / GENERATION_CONFIG_NAME, generation)
    return directory
