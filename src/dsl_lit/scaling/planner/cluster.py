"""The ``cluster`` config group: what the hardware can do, and how much of it software achieves.

Hardware numbers are spec-sheet values. Efficiencies are the planner's assumptions; each YAML in
``conf/cluster/`` documents where its values come from (first principles, public measurements and
this project's own; two are calibrated, each saying on what: ``activation_passes`` on our H200
step, ``grouped_gemm`` on the three published DeepSeek-V3 runs of :mod:`.published` together,
never one knob per run).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from data_contract.errors import ConfigError
from data_contract.schema import dataclass_from_dict

GIB = 2**30


@dataclass
class EfficiencyConfig:
    """Fractions of peak that real kernels and collectives reach (``cluster.efficiency.*``)."""

    gemm: float = 0.75
    """bf16/fp16/tf32 matmuls, as a fraction of the dense tensor-core peak."""
    fp8_gemm: float = 0.60
    """FP8 matmuls with DeepSeek-V3's fine-grained scaling, of the FP8 peak."""
    grouped_gemm: float = 0.8
    """Routed experts' grouped GEMMs, as a fraction of the dense GEMM rate of their precision
    (the one value fitted to the published DeepSeek-V3 runs; ``conf/cluster/h800.yaml``)."""
    attention: float = 0.5
    """Fused (flash) attention forward + backward, of the bf16 peak, on the causal half it computes."""
    hbm: float = 0.8
    """Memory-bound kernels (norms, activations, optimizer step), of the HBM bandwidth."""
    nvlink: float = 0.8
    ib: float = 0.9
    activation_passes: float = 8.0
    """HBM passes over each stored activation per step by the memory-bound (elementwise) kernels,
    per byte kept: at least 4 (written in forward, read in backward, its gradient written and
    read); calibrated to 8 on this project's H200 step (``conf/cluster/h800.yaml``)."""
    tp_overlap: float = 0.0
    """Fraction of tensor-parallel collectives hidden behind compute (0: Megatron's blocking ones)."""
    fragmentation: float = 0.05
    """Allocator overhead on top of the tensors (caching allocator's rounding and free blocks)."""

    def validate(self) -> EfficiencyConfig:
        for name in ("gemm", "fp8_gemm", "grouped_gemm", "attention", "hbm", "nvlink", "ib"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ConfigError(f"cluster.efficiency.{name}={value} must be in (0, 1]")
        if not 0 <= self.tp_overlap <= 1:
            raise ConfigError(f"cluster.efficiency.tp_overlap={self.tp_overlap} must be in [0, 1]")
        if self.activation_passes < 0 or self.fragmentation < 0:
            raise ConfigError("cluster.efficiency.activation_passes and fragmentation must be >= 0")
        return self


@dataclass
class ClusterConfig:
    """One homogeneous cluster: ``nodes`` x ``gpus_per_node`` GPUs of one kind."""

    name: str = "custom"
    gpu: str = "H800"
    nodes: int = 1
    gpus_per_node: int = 8
    memory_gib: float = 80.0
    peak_tflops_bf16: float = 989.0
    """Dense (no sparsity) tensor-core peak; fp16 is the same."""
    peak_tflops_fp8: float = 1979.0
    peak_tflops_fp32: float = 494.0
    """fp32 training runs its matmuls as TF32 on tensor cores."""
    hbm_tbps: float = 3.35
    nvlink_gbps: float = 200.0
    """Per GPU, one direction, GB/s."""
    ib_gbps: float = 50.0
    """Per GPU (one NIC each), one direction, GB/s."""
    sms: int = 132
    comm_sms: int = 20
    """SMs given to communication kernels while all-to-all overlaps compute (DeepSeek-V3: 20 of 132)."""
    reserved_gib: float = 3.0
    """Per GPU, never available to tensors: CUDA context, NCCL buffers, library workspaces."""
    efficiency: EfficiencyConfig = field(default_factory=EfficiencyConfig)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def peak_flops(self, dtype: str) -> float:
        """FLOP/s of one GPU for ``bf16`` | ``fp16`` | ``fp8`` | ``fp32`` matmuls."""
        tflops = {"bf16": self.peak_tflops_bf16, "fp16": self.peak_tflops_bf16, "fp8": self.peak_tflops_fp8,
                  "fp32": self.peak_tflops_fp32}[dtype]
        return tflops * 1e12

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ClusterConfig:
        values = dict(values)
        efficiency = dataclass_from_dict(EfficiencyConfig, dict(values.pop("efficiency", None) or {}),
                                         "cluster.efficiency")
        cluster = dataclass_from_dict(cls, values, "cluster")
        cluster.efficiency = efficiency
        return cluster

    def validate(self) -> ClusterConfig:
        for name in ("nodes", "gpus_per_node", "sms"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"cluster.{name}={value!r} must be a positive integer")
        for name in ("memory_gib", "peak_tflops_bf16", "peak_tflops_fp8", "peak_tflops_fp32", "hbm_tbps",
                     "nvlink_gbps", "ib_gbps"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"cluster.{name}={getattr(self, name)} must be positive")
        if not 0 <= self.comm_sms < self.sms:
            raise ConfigError(f"cluster.comm_sms={self.comm_sms} must be in [0, cluster.sms={self.sms})")
        if not 0 <= self.reserved_gib < self.memory_gib:
            raise ConfigError(f"cluster.reserved_gib={self.reserved_gib} must be in [0, memory_gib={self.memory_gib})")
        return self
