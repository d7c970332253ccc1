"""DeepSeek-V3's batch-size ramp and its token-counted lr schedule."""

from __future__ import annotations

import math

import pytest
from tokenizers import Tokenizer

from data_contract.errors import ConfigError
from data_contract.format import FIM_BEGIN_TOKEN
from dsl_lit.config.data import BatchRampConfig, BatchSchedule
from dsl_lit.config.optim import ScheduleConfig
from dsl_lit.data.packed import PackedTokens
from dsl_lit.data.sampler import GlobalBatchSampler
from dsl_lit.optim.schedules import schedule_multiplier
from tests.recipe_runs import losses, metric, run_recipe

RAMP = BatchSchedule(global_batch_size=16, seq_len=64, ramp=BatchRampConfig(start=4, tokens=64 * 60, increment=4))


def test_the_ramp_grows_in_increments_to_the_global_batch():
    sizes, consumed = [], 0
    for _ in range(12):
        sizes.append(RAMP.size_at(consumed))
        consumed += sizes[-1]
    assert sizes[0] == 4 and sizes[-1] == 16 and sorted(sizes) == sizes and set(sizes) == {4, 8, 12, 16}
    for steps in range(30):  # the closed form equals stepping one batch at a time
        stepped = 0
        for _ in range(steps):
            stepped += RAMP.size_at(stepped)
        assert RAMP.advance(0, steps) == stepped


def test_the_sampler_follows_the_ramp_and_tiles_the_stream_on_any_dp():
    """The ranks' slices of every ramped global batch tile the sample stream without gaps or
    repeats, for dp = 1, 2, 4, and a resume mid-ramp continues the same stream."""
    def stream(dp: int, consumed: int = 0, steps: int = 10) -> list[int]:
        samplers = [iter(GlobalBatchSampler(1000, 16, r, dp, seed=3, consumed_samples=consumed,
                                            batch_size_at=RAMP.size_at)) for r in range(dp)]
        return [i for _ in range(steps) for s in samplers for i in next(s)]

    one = stream(1)
    assert stream(2) == one and stream(4) == one
    assert len(one) == RAMP.advance(0, 10) and len(set(one)) == len(one)
    assert stream(2, consumed=RAMP.advance(0, 3), steps=7) == one[RAMP.advance(0, 3):]


@pytest.mark.parametrize("ramp, message", [
    (BatchRampConfig(start=5, tokens=100, increment=None), "data.batch_ramp.increment=5 must divide"),
    (BatchRampConfig(start=6, tokens=100, increment=2), "data.batch_ramp.start=6 must be a multiple"),
    (BatchRampConfig(start=32, tokens=100), r"data.batch_ramp.start=32 must be in \(0"),
    (BatchRampConfig(start=4, tokens=0), "needs both start"),
])
def test_bad_ramps_name_the_field(ramp, message):
    with pytest.raises(ConfigError, match=message):
        BatchSchedule(16, 64, ramp).validate(quantum=4)


def test_deepseek_v3_lr_schedule_in_tokens():
    """Warmup in steps, then the peak, the cosine, and the two tails at their token counts."""
    batches = BatchSchedule(16, 10, BatchRampConfig(start=4, tokens=400, increment=4))
    cfg = ScheduleConfig(name="deepseek_v3_tokens", warmup_steps=2, stable_tokens=1000, decay_tokens=1000,
                         min_ratio=0.1, tail_tokens=500, tail_ratio=0.03).validate()
    lr = schedule_multiplier(cfg, total_steps=1000, batches=batches)
    assert lr(0) == pytest.approx(0.5) and lr(1) == pytest.approx(1.0)
    tokens = [batches.advance(0, s) * 10 for s in range(400)]
    for step, t in enumerate(tokens[2:], start=2):
        if t < 1000:
            assert lr(step) == 1.0
        elif t < 2000:
            assert lr(step) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (t - 1000) / 1000)))
        elif t < 2500:
            assert lr(step) == 0.1
        else:
            assert lr(step) == 0.03


RUN = ["logger=csv", "trainer.accelerator=cpu", "data.fim_rate=0.5", "data.fim_spm_rate=0.5", "checkpoint.every_minutes=0", "checkpoint.async_save=false",
       "data.global_batch_size=16", "data.micro_batch_size=2", "data.batch_ramp.start=4", "data.batch_ramp.increment=4",
       "data.batch_ramp.tokens=2560", "schedule=deepseek_v3_tokens", "schedule.stable_tokens=5000",
       "schedule.decay_tokens=3000", "schedule.tail_tokens=1000", "schedule.warmup_steps=2"]


@pytest.mark.slow
def test_ramp_fim_and_v3_schedule_resume_mid_ramp_under_another_layout_exactly(tmp_path):
    """A tiny V3 pretraining with DeepSeek-V3's recipe: batch ramp, FIM (half the documents, in
    their own data cache), the token-counted lr schedule; stopped inside the ramp and resumed on
    two processes with the uninterrupted run's losses."""
    cache = f"data.cache_dir={tmp_path / 'fim_cache'}"
    full = tmp_path / "full"
    run_recipe(full, *RUN, cache, "trainer.max_steps=8", "checkpoint.every_n_steps=100")
    shards = PackedTokens(tmp_path / "fim_cache" / "shards")
    assert shards.meta["fim"] == {"rate": 0.5, "spm_rate": 0.5, "seed": 1234}
    fim_begin = Tokenizer.from_file(str(tmp_path / "fim_cache" / "tokenizer" / "tokenizer.json")).token_to_id(
        FIM_BEGIN_TOKEN)
    share = int((shards.window(0, len(shards)) == fim_begin).sum()) / shards.num_documents
    assert 0.45 < share < 0.55, share  # 1,625+ documents at rate 0.5
    sizes = {step: float(v) for step, v in metric(full, "train/global_batch_size").items()}
    assert [sizes[s] for s in range(8)] == [4, 4, 4, 8, 12, 16, 16, 16]  # 40 ramp samples, 4 stages
    split = tmp_path / "split"
    run_recipe(split, *RUN, cache, "trainer.max_steps=3", "checkpoint.every_n_steps=3")  # stops inside the ramp
    run_recipe(split, *RUN, cache, "trainer.max_steps=8", "checkpoint.every_n_steps=100", "trainer.devices=2")
    resumed, uninterrupted = losses(split), losses(full)
    for step in range(3):
        assert resumed[step] == uninterrupted[step]
    for step in range(3, 8):  # two data-parallel ranks: the same sums, reordered
        assert float(resumed[step]) == pytest.approx(float(uninterrupted[step]), rel=2e-3), step
    lr = metric(full, "train/lr")
    assert float(lr[0]) < float(lr[1]) == float(lr[7])  # warmup, then the peak until 5000 tokens
