"""DeepSeek-V4's quantised release, format by format: e2m1 codes and their packing two a byte
(checked against transformers' own unpacking), FP4 rows with power-of-two scales, block FP8 with
``ue8m0`` scales, a region read across the packing, and what a bad config.json is refused with.
A whole V4 model through these files: ``tests/unit/models/test_deepseek_v4_model.py``.

Error bounds are derived from the formats, not tuned: e2m1's magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6
are .5 apart up to 2, 1 apart up to 4, 2 apart up to 6, so rounding a scaled value v (|v| <= 6) to
the nearest one moves it by at most .25, .5 or 1 (half the gap it lies in), times the group's scale.
"""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

from data_contract.errors import ConfigError
from dsl_lit.hf.block_scaled import Region
from dsl_lit.hf.fp4_rows import FP4Rows, expert_dtype, pack_e2m1, unpack_e2m1
from dsl_lit.hf.fp8_blocks import BlockFP8
from dsl_lit.hf.quantised import Quantisation
from dsl_lit.precision.fp8_quantize import E2M1_VALUES, decode_e2m1, encode_e2m1

E8M0 = torch.float8_e8m0fnu
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


def _weights(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Normal values, each row scaled differently (so groups get different scales), a few outliers."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-6, 3, (rows, 1), generator=g).float())
    w.view(-1)[torch.randint(0, rows * cols, (rows,), generator=g)] *= 20
    return w


def test_every_e2m1_code_round_trips_and_rounds_to_nearest_even() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    values = decode_e2m1(codes)
    assert values.tolist() == list(E2M1_VALUES)
    assert torch.equal(encode_e2m1(values), codes)  # -0.0 keeps its sign bit: code 8
    # halfway between two codes: to the one with the even mantissa (1.0, 2.0, 4.0 and 0 have it)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -5.0])
    assert decode_e2m1(encode_e2m1(ties)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.0, -4.0]
    # otherwise the nearest, and beyond +-6 saturated
    x = torch.linspace(-7, 7, 2801)
    nearest = torch.tensor(E2M1_VALUES)[(x[:, None] - torch.tensor(E2M1_VALUES)).abs().argmin(dim=1)]
    off_ties = ~torch.isin(x.abs(), ties.abs())
    assert torch.equal(decode_e2m1(encode_e2m1(x))[off_ties], nearest[off_ties])


def test_nibble_order_is_transformers() -> None:
    """Two codes a byte, the even element in the low nibble: our unpacking decodes random bytes as
    transformers' ``Fp8Dequantize._unpack_fp4`` does, and packing inverts it."""
    packed = torch.randint(-128, 128, (6, 40), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    ours = decode_e2m1(unpack_e2m1(packed))
    theirs = Fp8Dequantize(None)._unpack_fp4(packed)
    assert ours.shape == (6, 80) and torch.equal(ours, theirs)
    assert torch.equal(pack_e2m1(unpack_e2m1(packed)), packed)
    assert torch.equal(unpack_e2m1(packed)[0, :2], torch.stack([packed[0, 0].view(torch.uint8) & 15,
                                                                 packed[0, 0].view(torch.uint8) >> 4]))


def test_fp4_rows_quantise_within_half_a_step_of_each_value() -> None:
    w = _weights(24, 192)
    fp4 = FP4Rows()
    values, scales = fp4.quantize(w)
    assert values.dtype == torch.int8 and values.shape == (24, 96)
    assert scales.dtype == E8M0 and scales.shape == (24, 6)
    s = scales.float()
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # powers of two, read back exactly
    # rounded up to the smallest power of two that fits each group's amax into +-6
    ratio = w.view(24, 6, 32).abs().amax(dim=-1) / s
    assert bool(((ratio > 3) & (ratio <= 6)).all())
    back = fp4.dequantize(values, s)
    # transformers dequantises the same bytes to the same values
    assert torch.equal(back, Fp8Dequantize(None)._dequantize_one(values, scales, output_dtype=torch.float32))
    full = s.repeat_interleave(32, dim=1)
    v = w.abs() / full
    half_step = torch.where(v <= 2, 0.25, torch.where(v <= 4, 0.5, 1.0))
    assert bool(((back - w).abs() <= half_step * full).all())


def test_block_fp8_with_ue8m0_scales_rounds_them_up_to_powers_of_two() -> None:
    w = _weights(200, 300)  # ragged edge blocks both ways
    plain, pow2 = BlockFP8(), BlockFP8(scale_fmt="ue8m0")
    assert plain.quantize(w)[1].dtype == torch.float32  # DeepSeek-V3's, unchanged
    values, scales = pow2.quantize(w)
    assert values.dtype == torch.float8_e4m3fn and scales.dtype == E8M0 and scales.shape == (2, 3)
    s = scales.float()
    full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
    amax = torch.nn.functional.pad(w.abs(), (0, 84, 0, 56)).view(2, 128, 3, 128).amax(dim=(1, 3))
    assert bool(((amax / s > 224) & (amax / s <= 448)).all())
    back = pow2.dequantize(values, s)
    assert torch.equal(back, values.float() * full)
    # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 of the value; subnormals' 2^-10 of the scale
    assert bool(((back - w).abs() <= w.abs() * 2**-4 + full * 2**-10).all())
    assert pow2.hf_config() == {**QUANT, "scale_fmt": "ue8m0"} and plain.hf_config() == QUANT


@pytest.mark.parametrize(("offsets", "size"), [((3, 18), (9, 44)), ((0, 9), (24, 1)), ((20, 64), (4, 128))],
                         ids=["even-column", "odd-column", "aligned"])
def test_a_region_reads_the_groups_covering_it(offsets: tuple[int, int], size: tuple[int, int]) -> None:
    """A rank's rows and columns: the bytes and scales of the 32-column groups over its columns only
    (two values a byte: columns 18..62 are bytes 0..31), equal to the same slice of the whole."""
    w = _weights(24, 192, seed=2)
    fp4 = FP4Rows()
    values, scales = fp4.quantize(w)
    whole = fp4.dequantize(values, scales.float())
    asked: list[Region] = []

    def reader(tensor: torch.Tensor):
        def read(region: Region) -> torch.Tensor:
            asked.append(region)
            return tensor[region]
        return read

    part = fp4.read_region(reader(values), reader(scales), (24, 192), offsets, size)
    (r, c), (n, m) = offsets, size
    assert torch.equal(part, whole[r : r + n, c : c + m])
    first, last = c // 32, (c + m - 1) // 32  # the groups the columns touch
    assert asked == [(slice(r, r + n), slice(first * 16, (last + 1) * 16)),
                     (slice(r, r + n), slice(first, last + 1))]


def test_the_release_config_declares_fp4_experts_both_places() -> None:
    config = {"quantization_config": {**QUANT, "scale_fmt": "ue8m0"}, "expert_dtype": "fp4"}  # V4's
    quantisation = Quantisation.from_hf_config(config)
    assert quantisation == Quantisation(BlockFP8(scale_fmt="ue8m0"), FP4Rows())
    v41 = {"quantization_config": {**QUANT, "scale_fmt": "ue8m0", "expert_dtype": "fp4"}}
    assert Quantisation.from_hf_config(v41) == quantisation
    assert quantisation.hf_config() == {"quantization_config": {**QUANT, "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
                                        "expert_dtype": "fp4"}
    assert Quantisation.from_hf_config({"quantization_config": QUANT}) == Quantisation(BlockFP8())  # V3's
    assert expert_dtype({"expert_dtype": "fp4"}) == "fp4" and Quantisation.from_hf_config({"expert_dtype": "fp4"}) is None


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"quantization_config": {**QUANT, "scale_fmt": "e5m2"}},
         r"quantization_config\.scale_fmt='e5m2' is not supported; use 'float'"),
        ({"quantization_config": QUANT, "expert_dtype": "fp6"},
         r"^config\.json expert_dtype='fp6' is not supported; use 'fp4'"),
        ({"quantization_config": {**QUANT, "expert_dtype": "int4"}},
         r"quantization_config\.expert_dtype='int4' is not supported"),
        ({"quantization_config": {**QUANT, "expert_dtype": "fp8"}, "expert_dtype": "fp4"}, "disagree; keep one"),
    ],
    ids=["scale_fmt", "expert_dtype", "inner-expert_dtype", "both"],
)
def test_unknown_quantisation_fields_are_config_errors(config: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Quantisation.from_hf_config(config)


def test_an_fp4_weight_needs_whole_scale_groups() -> None:
    with pytest.raises(ConfigError, match=r"its input dim must be a multiple of 32 .* save with fp8=False"):
        FP4Rows().quantize(torch.randn(4, 48))
