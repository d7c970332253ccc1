"""The ``profiler`` config group: a torch.profiler trace of a few training steps on every rank."""

from __future__ import annotations

from dataclasses import dataclass

from data_contract.errors import ConfigError


@dataclass
class ProfilerConfig:
    """Skip ``wait`` optimizer steps, warm up for ``warmup`` (recorded, then discarded: the first
    profiled steps carry the profiler's own start-up cost), record ``active`` steps; ``repeat``
    such cycles (0: until training ends). Each cycle writes one Chrome/Perfetto trace per rank to
    ``<run dir>/profiler/``. ``profile_memory`` adds tensor allocations to the trace and, on CUDA,
    a memory snapshot of the active steps (open it at https://pytorch.org/memory_viz)."""

    enabled: bool = False
    wait: int = 1
    warmup: int = 1
    active: int = 2
    repeat: int = 1
    profile_memory: bool = False
    record_shapes: bool = False
    with_stack: bool = False

    @property
    def steps_per_cycle(self) -> int:
        return self.wait + self.warmup + self.active

    def validate(self) -> ProfilerConfig:
        for name in ("wait", "warmup", "repeat"):
            if getattr(self, name) < 0:
                raise ConfigError(f"profiler.{name}={getattr(self, name)} must be >= 0")
        if self.active < 1:
            raise ConfigError(f"profiler.active={self.active} must be >= 1 (steps recorded per trace)")
        return self
