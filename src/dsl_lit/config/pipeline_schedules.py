"""Pipeline schedules: one torch-free table that validation, the runtime and the planner all read.

A row says how a schedule places stages on the pipeline ranks and what it needs of a step; code
asks a row's fields (``stages_per_rank``, ``placement``, ``splits_backward``, ...), never compares
schedule names. The runtime runs the rows with a ``torch_class`` (a class of
``torch.distributed.pipelining``); the others are the planner's, planned only (ZB1P, DualPipe).
A new schedule is one row here (and, if dsl-lit runs it, a class torch ships).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class PipelineSchedule:
    name: str
    torch_class: str | None
    """The ``torch.distributed.pipelining`` class dsl-lit runs it with; None: planned only."""
    stages_per_rank: int | None
    """Stages (model chunks) one pp rank runs: fixed, or None for ``parallel.pp_virtual_stages`` (>= 2)."""
    placement: Literal["round_robin", "v", "both_directions"]
    """``round_robin``: rank r holds stages r, r + pp, ... (one stage: stage r); ``v``: rank r holds
    stages r and 2 pp - 1 - r (DualPipeV's V); ``both_directions``: DualPipe's two pipelines in
    opposite directions over the same pp stages, rank r holding stage r of one and pp - 1 - r of the other."""
    min_micro_batches_per_pp_rank: int = 0
    """Micro-batches per step it needs: at least this times ``parallel.pp`` (0: no minimum)."""
    micro_batches_multiple_of_pp: bool = False
    """Whether the micro-batches per step must be a multiple of ``parallel.pp`` (or fewer than it)."""
    splits_backward: bool = False
    """Whether each backward runs as input gradients then weight gradients, the first keeping the
    graph for the second (zero-bubble schedules)."""
    overlaps_all_to_all: bool = False
    """Whether a micro-batch's expert all-to-alls (and stage sends) hide under a paired micro-batch's compute."""

    @property
    def runs(self) -> bool:
        return self.torch_class is not None

    @property
    def copies_per_stage(self) -> int:
        """Pipeline ranks holding each stage's weights (DualPipe's two directions: 2)."""
        return 2 if self.placement == "both_directions" else 1

    def chunks_per_rank(self, pp_virtual_stages: int) -> int:
        return self.stages_per_rank if self.stages_per_rank is not None else pp_virtual_stages

    def n_stages(self, pp: int, pp_virtual_stages: int) -> int:
        """Distinct stages the layers are cut into (DualPipe's two directions share theirs)."""
        return pp if self.placement == "both_directions" else pp * self.chunks_per_rank(pp_virtual_stages)

    def stages_of_rank(self, pp_rank: int, pp: int, pp_virtual_stages: int) -> list[int]:
        """Indices of the stages pp rank ``pp_rank`` runs, in the order the schedule expects."""
        if self.placement == "v":
            return [pp_rank, 2 * pp - 1 - pp_rank]
        if self.placement == "both_directions":
            return [pp_rank, pp - 1 - pp_rank]
        return [pp_rank + k * pp for k in range(self.chunks_per_rank(pp_virtual_stages))]


SCHEDULE_TABLE: dict[str, PipelineSchedule] = {row.name: row for row in (
    PipelineSchedule("GPipe", "ScheduleGPipe", 1, "round_robin"),
    PipelineSchedule("1F1B", "Schedule1F1B", 1, "round_robin", min_micro_batches_per_pp_rank=1),
    PipelineSchedule("Interleaved1F1B", "ScheduleInterleaved1F1B", None, "round_robin", micro_batches_multiple_of_pp=True),
    PipelineSchedule("ZB1P", None, 1, "round_robin", splits_backward=True),
    PipelineSchedule("DualPipe", None, 2, "both_directions", splits_backward=True, overlaps_all_to_all=True),
    PipelineSchedule("DualPipeV", "ScheduleDualPipeV", 2, "v", min_micro_batches_per_pp_rank=2, splits_backward=True,
                     overlaps_all_to_all=True),
)}

RUNNABLE = tuple(name for name, row in SCHEDULE_TABLE.items() if row.runs)
"""The schedules ``parallel.pp_schedule`` takes (the others the planner plans only)."""


def schedule(name: str) -> PipelineSchedule:
    return SCHEDULE_TABLE[name]


def stages_of_rank(pp_rank: int, pp: int, virtual: int, schedule_name: str) -> list[int]:
    """Indices of the stages this pp rank runs under ``schedule_name``, in the order the schedule expects."""
    return SCHEDULE_TABLE[schedule_name].stages_of_rank(pp_rank, pp, virtual)
