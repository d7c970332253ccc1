"""The pipeline schedule table (``config/pipeline_schedules.py``): the one place a schedule is
described, read by validation, the runtime and the planner alike."""

from __future__ import annotations

import pytest
import torch.distributed.pipelining as pipelining

from data_contract.errors import ConfigError
from dsl_lit.config.parallel import ParallelConfig, validate_pipeline_micro_batches
from dsl_lit.config.pipeline_schedules import RUNNABLE, SCHEDULE_TABLE, PipelineSchedule, stages_of_rank
from dsl_lit.scaling.planner.memory import IN_FLIGHT
from dsl_lit.scaling.planner.step_time import BUBBLE


def test_every_row_is_runnable_by_torch_or_planned_with_its_formulas():
    for name, row in SCHEDULE_TABLE.items():
        assert row.name == name
        if row.runs:
            assert issubclass(getattr(pipelining, row.torch_class), pipelining.schedules._PipelineSchedule), name
        assert name in IN_FLIGHT and name in BUBBLE, f"the planner has no activation or bubble formula for {name}"
    assert RUNNABLE == ("GPipe", "1F1B", "Interleaved1F1B", "DualPipeV")


def test_placement_comes_from_the_row():
    # every stage on exactly one rank (twice under DualPipe's two directions), in the schedule's order
    for name, row in SCHEDULE_TABLE.items():
        pp, virtual = 4, 3
        held = [s for r in range(pp) for s in stages_of_rank(r, pp, virtual, name)]
        assert sorted(held) == sorted(list(range(row.n_stages(pp, virtual))) * row.copies_per_stage), name
    assert stages_of_rank(0, 4, 2, "DualPipeV") == [0, 7] and stages_of_rank(0, 4, 1, "DualPipe") == [0, 3]
    assert stages_of_rank(1, 4, 3, "Interleaved1F1B") == [1, 5, 9]


def test_a_new_schedule_is_one_row(monkeypatch):
    """A row whose needs differ from every existing one: validation reads them from the row."""
    row = PipelineSchedule("Looped3", "ScheduleLoopedBFS", 3, "round_robin", min_micro_batches_per_pp_rank=3)
    monkeypatch.setitem(SCHEDULE_TABLE, row.name, row)
    parallel = ParallelConfig(pp=2, pp_schedule="Looped3")
    with pytest.raises(ConfigError, match=r"^parallel\.pp_schedule=Looped3 needs at least 3 x parallel\.pp=6 "):
        validate_pipeline_micro_batches(parallel, 5)
    validate_pipeline_micro_batches(parallel, 6)
    assert row.stages_of_rank(1, 2, 1) == [1, 3, 5] and row.n_stages(2, 1) == 6
