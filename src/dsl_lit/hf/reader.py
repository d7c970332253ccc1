"""An HF checkpoint directory opened for reading by name and region, without loading it.

Opening reads ``config.json`` (our ``ModelConfig`` through the family adapter), the weight map
(``model.safetensors`` or ``model.safetensors.index.json``) and every tensor's shape and dtype from
the safetensors headers; no weight is read. :meth:`HFCheckpoint.check` then validates names and
shapes against a model (on the meta device) with the adapter's own translation, so a wrong
checkpoint fails before any memory is spent, with the messages a full load gives.

:meth:`HFCheckpoint.fill` reads exactly the regions a process holds: each of our tensors from the HF
tensors :meth:`~dsl_lit.models.common.hf_adapter.HFAdapter.hf_sources` names (experts stacked from
their per-expert tensors, only this rank's experts), sliced to this rank's shard, dequantised
block by block when the checkpoint is quantised (block FP8, :mod:`dsl_lit.hf.fp8_blocks`; DeepSeek-V4's
FP4 experts, :mod:`dsl_lit.hf.fp4_rows`; which is which: :mod:`dsl_lit.hf.quantised`), converted to
the target's dtype, one tensor at a time, shard file by shard file. Weights are only ever read from
safetensors (never unpickled).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from data_contract.errors import ConfigError
from dsl_lit.hf.block_scaled import SCALE_SUFFIX, BlockScaled, Region
from dsl_lit.hf.quantised import FP4_DTYPE, FP8_DTYPES, Quantisation
from dsl_lit.hf.safetensors_file import SafetensorsFile
from dsl_lit.models import ModelConfig
from dsl_lit.models.common.hf_adapter import HFAdapter, few
from dsl_lit.models.registry import hf_reader

CONFIG_NAME = "config.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_INDEX_NAME = "model.safetensors.index.json"
_PICKLE_PATTERNS = ("pytorch_model*.bin", "*.bin", "*.pt", "*.pth", "*.ckpt")

Target = tuple[torch.Tensor, tuple[int, ...]]
"""A tensor to fill (this process's part of one of our tensors) and its offset in the full tensor."""


def read_json(path: Path) -> dict[str, Any]:
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return data


def hub_blobs(directory: Path) -> Path | None:
    """The ``blobs/`` folder of a Hugging Face hub cache entry when ``directory`` is one of its
    snapshots (``models--org--name/snapshots/<revision>``, whose files are symlinks into
    ``../../blobs/``): the same download, so its shards may resolve there. None otherwise."""
    if directory.parent.name != "snapshots":
        return None
    blobs = directory.parent.parent / "blobs"
    return blobs.resolve() if blobs.is_dir() and not blobs.is_symlink() else None


def weight_map(directory: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file holding it, from a single file or a sharded index."""
    single = directory / SAFE_WEIGHTS_NAME
    index = directory / SAFE_INDEX_NAME
    if single.is_file():
        file = SafetensorsFile(single)
        file.close()
        return dict.fromkeys(file.entries, single)
    if index.is_file():
        mapping = read_json(index).get("weight_map")
        if not isinstance(mapping, dict) or not mapping:
            raise ConfigError(f"{index} has no 'weight_map'")
        files = {name: directory / fname for name, fname in mapping.items()}
        roots = [directory.resolve()]
        blobs = hub_blobs(directory)
        outside = sorted({fname for fname, path in zip(mapping.values(), files.values())
                          if not path.resolve().is_relative_to(roots[0])
                          and not (blobs is not None and Path(fname).name == fname
                                   and path.resolve().is_relative_to(blobs))})
        if outside:  # symlinks resolved: a shard list may not reach files the user did not name
            raise ConfigError(f"{index} maps tensors to files outside {directory}: {few(outside)}; "
                              "every shard must lie in the checkpoint directory (or, for a Hugging Face hub "
                              "snapshot, in its blobs/)")
        absent = sorted({str(p.name) for p in files.values() if not p.is_file()})
        if absent:
            raise ConfigError(f"{index} names shard(s) that are not in {directory}: {few(absent)}")
        return files
    pickles = sorted({p.name for pattern in _PICKLE_PATTERNS for p in directory.glob(pattern)})
    if pickles:
        raise ConfigError(
            f"{directory} has only pickled weights ({few(pickles)}); dsl_lit reads safetensors only and "
            "never unpickles checkpoints. Convert them to safetensors with a tool you trust first"
        )
    raise FileNotFoundError(f"{directory} has neither {SAFE_WEIGHTS_NAME} nor {SAFE_INDEX_NAME}")


def check_state_dict(state: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], what: str) -> None:
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


def _headers(files: Mapping[str, Path]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every tensor, from the safetensors headers (no tensor data is read)."""
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for path, names in by_file.items():
        file = SafetensorsFile(path)
        file.close()
        lost = [n for n in names if n not in file.entries]
        if lost:
            raise ConfigError(f"{path.name} lacks tensor(s) its index assigns to it: {few(lost)}")
        out.update({name: file.entries[name][:2] for name in names})
    return out


class _OpenFiles:
    """The files being read, at most ``keep`` open at a time."""

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self._open: OrderedDict[Path, SafetensorsFile] = OrderedDict()

    def get(self, path: Path) -> SafetensorsFile:
        if path in self._open:
            self._open.move_to_end(path)
            return self._open[path]
        while len(self._open) >= self.keep:
            self._open.popitem(last=False)[1].close()
        self._open[path] = SafetensorsFile(path)
        return self._open[path]

    def close(self) -> None:
        while self._open:
            self._open.popitem()[1].close()


class HFCheckpoint:
    """One HF checkpoint directory, opened (config, adapter, weight map, headers) but not read."""

    def __init__(self, path: str | Path, attn_backend: str = "sdpa") -> None:
        directory = Path(path)
        if not (directory / CONFIG_NAME).is_file():
            raise FileNotFoundError(f"{directory} is not a Hugging Face checkpoint directory (no {CONFIG_NAME})")
        self.directory = directory
        self.hf_config = read_json(directory / CONFIG_NAME)
        self.adapter: HFAdapter = hf_reader(self.hf_config.get("model_type"))
        self.quantisation = Quantisation.from_hf_config(self.hf_config)
        self.fp8 = self.quantisation.fp8 if self.quantisation is not None else None
        self.formats: dict[str, BlockScaled] = {}
        """Quantised weight -> the format it is stored in (from :meth:`_check_quantised`)."""
        stored = weight_map(directory)
        headers = _headers(stored)
        self.stored_as: dict[str, str] = {}
        """Release name -> the name the files store it under (the adapter's :meth:`release_name`)."""
        for name in stored:
            release = self.adapter.release_name(name)
            if release in self.stored_as:
                raise ConfigError(f"{directory} stores {release!r} twice: as {self.stored_as[release]!r} and {name!r}")
            self.stored_as[release] = name
        self.files = {release: stored[name] for release, name in self.stored_as.items()}
        self.headers = {release: headers[name] for release, name in self.stored_as.items()}
        self._check_quantised()
        cfg = self.adapter.config_for_checkpoint(self.adapter.config_from_hf(self.hf_config), self.weight_names)
        cfg.name = directory.resolve().name
        cfg.attn_backend = attn_backend  # type: ignore[assignment]
        cfg.validate()
        self.config: ModelConfig = cfg
        self.bytes_read = 0
        """Bytes of tensor data :meth:`fill` has read so far (as stored: quantised values and their scales)."""

    @property
    def weight_names(self) -> list[str]:
        """Every stored tensor but the block scales."""
        return [n for n in self.files if not self.is_scale(n)]

    def is_scale(self, hf_name: str) -> bool:
        return self.quantisation is not None and hf_name.endswith(SCALE_SUFFIX)

    def is_quantised(self, hf_name: str) -> bool:
        return hf_name in self.formats

    def _check_quantised(self) -> None:
        """Every quantised weight has its block scales (of the shape its format needs) and every
        scale its weight; which format each weight is in, from its dtype (:attr:`formats`)."""
        where, quant = f"{self.directory}", self.quantisation
        for name, (shape, dtype) in self.headers.items():
            if quant is None or not name.endswith(SCALE_SUFFIX):
                continue
            weight = name.removesuffix(SCALE_SUFFIX)
            if weight not in self.headers:
                raise ConfigError(f"{where}: {name!r} scales a weight the checkpoint does not hold ({weight!r})")
            w_shape, w_dtype = self.headers[weight]
            if len(w_shape) != 2:
                raise ConfigError(f"{where}: {weight!r} has block scales but is {w_dtype} of shape {w_shape}, "
                                  "not a 2-D weight")
            if not dtype.is_floating_point:
                raise ConfigError(f"{where}: {self.stored_as[name]!r} is {dtype}; block scales are fp32 or, for "
                                  "scale_fmt 'ue8m0', float8_e8m0fnu")
            fmt = quant.stored_as(weight, w_dtype, where)
            logical = fmt.logical_shape(w_shape)
            if shape != fmt.scale_shape(logical):
                raise ConfigError(
                    f"{where}: {self.stored_as[name]!r} has shape {shape}; a {logical} {fmt.kind} weight in {list(fmt.block)} "
                    f"blocks needs {fmt.scale_shape(logical)} (config.json's quantization_config does not describe "
                    "these files: fix it or re-export them)"
                )
            self.formats[weight] = fmt
        scaled_dtypes = FP8_DTYPES + ((FP4_DTYPE,) if quant is not None and quant.fp4 is not None else ())
        for name, (_, dtype) in self.headers.items():
            if dtype in scaled_dtypes and not self.is_quantised(name):
                raise ConfigError(
                    f"{where}: {name!r} is stored as {dtype} without {self.adapter.scale_name(name)!r}"
                    + ("" if quant else " and config.json has no quantization_config")
                )

    def shape_of(self, hf_name: str) -> tuple[int, ...]:
        """A tensor's shape as the model holds it: a packed FP4 weight's is twice as wide as stored."""
        shape = self.headers[hf_name][0]
        fmt = self.formats.get(hf_name)
        return fmt.logical_shape(shape) if fmt is not None else shape

    def stored_dtype(self, hf_name: str) -> torch.dtype:
        """What a tensor reads as without a dtype asked: as stored, fp32 for a dequantised weight."""
        return torch.float32 if self.is_quantised(hf_name) else self.headers[hf_name][1]

    def check(self, expected: Mapping[str, torch.Tensor]) -> None:
        """ConfigError unless the checkpoint holds exactly ``expected``'s tensors (a model's whole
        state dict, on the meta device): translated by the adapter from the headers alone."""
        meta = {
            name: torch.empty(self.shape_of(name), dtype=self.stored_dtype(name), device="meta")
            for name in self.weight_names
        }
        state = self.adapter.from_hf(meta, self.config)
        check_state_dict(state, expected, what=f"loading {self.directory}")

    def dtype_for(self, name: str, dtype: torch.dtype | None) -> torch.dtype | None:
        """The dtype our tensor ``name`` loads in when ``dtype`` is asked (None: as stored): fp32 for
        what the adapter keeps in fp32; None (as built) for a tensor HF does not store."""
        source = self.adapter.hf_sources([name], self.config)[name]
        if not source.names:
            return None
        if self.adapter.keeps_fp32(source.names[0]):
            return torch.float32
        stored = self.stored_dtype(source.names[0])
        if not stored.is_floating_point:  # a table of ids (DeepSeek-V4's tid2eid) is never cast
            return stored
        return dtype or stored

    @torch.no_grad()
    def fill(self, targets: Mapping[str, Target]) -> None:
        """Read each target's region of our tensor of that name, file by file."""
        sources = self.adapter.hf_sources(targets, self.config)
        absent = sorted({n for s in sources.values() for n in s.names if n not in self.files})
        if absent:
            raise ConfigError(f"{self.directory} lacks tensor(s) the model needs: {few(absent)}")
        order = sorted(targets, key=lambda n: str(self.files[sources[n].names[0]]) if sources[n].names else "")
        files = _OpenFiles()
        try:
            for name in order:
                tensor, offsets = targets[name]
                source = sources[name]
                if not source.names:
                    tensor.zero_()
                elif source.stacked:  # dim 0 counts experts: read this rank's ones only
                    for i in range(tensor.shape[0]):
                        part = self._read(files, source.names[offsets[0] + i], offsets[1:], tensor.shape[1:])
                        tensor[i].copy_(part)
                else:
                    tensor.copy_(self._read(files, source.names[0], offsets, tensor.shape))
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    bad = source.names[0] if len(source.names) == 1 else f"one of {few(source.names)}"
                    scale = f" (or its {SCALE_SUFFIX})" if any(self.is_quantised(n) for n in source.names) else ""
                    raise ConfigError(f"{self.files[source.names[0]]}: tensor {bad}{scale} holds NaN or inf values; "
                                      "training would start from broken weights (re-download or re-export it)")
        finally:
            files.close()

    def _read(self, files: _OpenFiles, hf_name: str, offsets: tuple[int, ...], size: torch.Size) -> torch.Tensor:
        shape = self.shape_of(hf_name)
        if len(size) != len(shape) or any(o + s > n for o, s, n in zip(offsets, size, shape)):
            raise ConfigError(f"{hf_name} has shape {shape}; the model reads {tuple(size)} at offset {offsets}")
        path = self.files[hf_name]
        fmt = self.formats.get(hf_name)
        if fmt is not None:
            scale = hf_name + SCALE_SUFFIX

            def read_weight(region: Region) -> torch.Tensor:
                return self._counted(files.get(path).read(self.stored_as[hf_name], region))

            def read_scale(region: Region) -> torch.Tensor:
                return self._counted(files.get(self.files[scale]).read(self.stored_as[scale], region))

            return fmt.read_region(read_weight, read_scale, shape, offsets, size)
        whole = tuple(size) == tuple(shape)
        region = None if whole else tuple(slice(o, o + s) for o, s in zip(offsets, size))
        return self._counted(files.get(path).read(self.stored_as[hf_name], region))

    def _counted(self, tensor: torch.Tensor) -> torch.Tensor:
        self.bytes_read += tensor.untyped_storage().nbytes()  # the whole read, before any slicing
        return tensor
