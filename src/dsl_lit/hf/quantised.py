"""Which block format each weight of a quantised checkpoint is stored in: one decision for reading
(from config.json and the stored dtypes) and for writing (from the family adapter's release).

DeepSeek-V3's release: every quantised weight block FP8 with fp32 scales. DeepSeek-V4's: block FP8
with ``float8_e8m0fnu`` scales (``scale_fmt`` "ue8m0"), its routed experts FP4 (``expert_dtype``
"fp4", :mod:`dsl_lit.hf.fp4_rows`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from data_contract.errors import ConfigError
from dsl_lit.hf.block_scaled import BlockScaled
from dsl_lit.hf.fp4_rows import FP4Rows, expert_dtype
from dsl_lit.hf.fp8_blocks import BlockFP8
from dsl_lit.models.common.hf_adapter import HFAdapter

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP4_DTYPE = torch.int8
"""What DeepSeek-V4's release stores its packed e2m1 pairs as (transformers reads ``uint8`` too)."""


@dataclass(frozen=True)
class Quantisation:
    """A checkpoint's quantised formats: block FP8, and FP4 rows for the routed experts if any."""

    fp8: BlockFP8
    fp4: FP4Rows | None = None

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> Quantisation | None:
        """What ``config.json`` declares (None without ``quantization_config``; an ``expert_dtype``
        alone quantises nothing, as transformers reads it); ConfigError naming a field we cannot read."""
        fp8 = BlockFP8.from_hf_config(hf_config)
        experts = expert_dtype(hf_config)
        if fp8 is None:
            return None
        return cls(fp8, FP4Rows(scale_fmt=fp8.scale_fmt) if experts == "fp4" else None)

    @classmethod
    def release_of(cls, adapter: HFAdapter) -> Quantisation:
        """The quantised release of ``adapter``'s layout; ConfigError when the layout has none."""
        if adapter.fp8_weights is None:
            raise ConfigError(f"fp8=True: the {adapter.family} family's Hugging Face layout ({adapter.model_type}) has "
                              "no FP8 form; save it in bf16 (dtype='bfloat16')")
        fp8 = BlockFP8(scale_fmt=adapter.scale_fmt)
        return cls(fp8, FP4Rows(scale_fmt=adapter.scale_fmt) if adapter.fp4_weights is not None else None)

    def hf_config(self) -> dict[str, Any]:
        """The config.json entries declaring these formats: ``quantization_config``, and with FP4
        experts ``expert_dtype`` both inside it (V4.1's place) and at the top level (V4's)."""
        quant = self.fp8.hf_config()
        if self.fp4 is None:
            return {"quantization_config": quant}
        return {"quantization_config": {**quant, "expert_dtype": "fp4"}, "expert_dtype": "fp4"}

    def written_as(self, adapter: HFAdapter, hf_name: str) -> BlockScaled | None:
        """The format the release stores ``hf_name`` in (None: unquantised)."""
        if self.fp4 is not None and adapter.quantizes_fp4(hf_name):
            return self.fp4
        return self.fp8 if adapter.quantizes_fp8(hf_name) else None

    def stored_as(self, hf_name: str, dtype: torch.dtype, where: str) -> BlockScaled:
        """The format of a weight stored as ``dtype`` next to scales; ConfigError naming it and
        ``where`` it is when the dtype is neither FP8 nor (declared) FP4."""
        if dtype in FP8_DTYPES:
            return self.fp8
        if dtype == FP4_DTYPE and self.fp4 is not None:
            return self.fp4
        if dtype == FP4_DTYPE:
            raise ConfigError(f"{where}: {hf_name!r} is stored as {dtype} with block scales, FP4 as DeepSeek-V4 "
                              "packs it, but config.json declares no expert_dtype 'fp4'; add \"expert_dtype\": "
                              "\"fp4\" to it (or to its quantization_config)")
        raise ConfigError(f"{where}: {hf_name!r} has block scales but is {dtype}, neither FP8 nor packed FP4 (int8)")
