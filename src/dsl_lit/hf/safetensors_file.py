"""Reading regions of one safetensors file with plain positioned reads (no memory map).

Why not ``safetensors.safe_open``: it maps the whole file, and every page a read touches then
counts in the process's resident memory until the file is closed, so reading a rank's part of a
5 GB shard costs up to 5 GB more than the part. Here exactly the bytes of the rows a region
spans are read into a fresh buffer (the kernel's page cache is not the process's memory).

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length,
a JSON header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": ...}``,
then the tensors' bytes, C-contiguous and little-endian, offsets relative to the header's end.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path
from typing import Any

import torch

from data_contract.errors import ConfigError

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip
_MAX_HEADER = 100 * 2**20


class SafetensorsFile:
    """One ``.safetensors`` file: its header parsed at open, tensors read region by region."""

    def __init__(self, path: Path) -> None:
        if sys.byteorder != "little":
            raise RuntimeError("safetensors data is little-endian; this reader runs on little-endian hosts only")
        self.path = path
        self._file = path.open("rb")
        try:
            (length,) = struct.unpack("<Q", self._file.read(8))
            if length > _MAX_HEADER:
                raise ConfigError(f"{path} is not a safetensors file (header of {length} bytes)")
            header: dict[str, Any] = json.loads(self._file.read(length))
        except (struct.error, json.JSONDecodeError, UnicodeDecodeError) as error:
            self._file.close()
            raise ConfigError(f"{path} is not a safetensors file: {error}") from None
        header.pop("__metadata__", None)
        self._start = 8 + length
        size = path.stat().st_size
        self.entries: dict[str, tuple[tuple[int, ...], torch.dtype, int]] = {}
        """name -> (shape, dtype, offset of its first byte in the file)."""
        for name, entry in header.items():
            if entry.get("dtype") not in DTYPES:
                self._file.close()
                raise ConfigError(f"{path.name}: tensor {name!r} has dtype {entry.get('dtype')}, which dsl_lit cannot read")
            shape, dtype = tuple(entry["shape"]), DTYPES[entry["dtype"]]
            begin, end = entry["data_offsets"]
            if end - begin != math.prod(shape) * dtype.itemsize or self._start + end > size:
                self._file.close()
                raise ConfigError(f"{path.name}: tensor {name!r} has inconsistent data offsets {begin}..{end}")
            self.entries[name] = (shape, dtype, self._start + begin)

    def read(self, name: str, region: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Tensor ``name``, or its ``region`` (one step-1 slice per dim): the rows of dim 0 it spans
        are read whole, the other dims are then sliced."""
        shape, dtype, offset = self.entries[name]
        first, stop = (0, shape[0]) if region is None or not shape else (region[0].start, region[0].stop)
        row = math.prod(shape[1:]) * dtype.itemsize
        buffer = torch.empty((stop - first) * row, dtype=torch.uint8)
        self._file.seek(offset + first * row)
        if buffer.numel() and self._file.readinto(buffer.numpy()) != buffer.numel():
            raise ConfigError(f"{self.path.name}: tensor {name!r} is truncated")
        tensor = buffer.view(dtype).reshape(stop - first, *shape[1:]) if shape else buffer.view(dtype).reshape(())
        return tensor if region is None else tensor[(slice(None), *region[1:])]

    def close(self) -> None:
        self._file.close()
