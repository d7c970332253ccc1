"""The layout's steps of :func:`~dsl_lit.parallel.model_transforms.transform_model`: what each
parallel dimension does to a built model, as plain functions of the model and the mesh.

They run in :data:`~dsl_lit.parallel.model_transforms.TRANSFORM_ORDER` (after FP8 and recompute,
before compile): the pipeline cut drops the blocks this rank does not own, then tensor, expert and
context parallelism shard what is left. Frozen copies that sample beside the policy (a KL
reference) are cut and sharded alike, so a rank holds the same part of each.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dsl_lit.config.model import ModelConfig
from dsl_lit.config.parallel import ParallelLayout
from dsl_lit.parallel.context_parallel import apply_context_parallel
from dsl_lit.parallel.expert_parallel import apply_expert_parallel
from dsl_lit.parallel.step_runner import MeshStepRunner, PipelineStepRunner
from dsl_lit.parallel.tensor_parallel import apply_tensor_parallel


def cut_pipeline(runner: MeshStepRunner, model: nn.Module, model_config: ModelConfig, with_mtp: bool,
                 copies: Sequence[nn.Module]) -> None:
    """Keep this rank's pipeline stages of ``model`` and ``copies``; the runner steps through them."""
    assert isinstance(runner, PipelineStepRunner)  # the strategy builds one wherever pp > 1
    runner.cut(model, model_config, with_mtp, copies)


def shard_tensor(mesh: DeviceMesh, model: nn.Module, model_config: ModelConfig, sequence_parallel: bool,
                 hook_gradients: bool, copies: Sequence[nn.Module]) -> None:
    apply_tensor_parallel(model, model_config, mesh["tp"], sequence_parallel, hook_gradients=hook_gradients)
    for copy in copies:
        apply_tensor_parallel(copy, model_config, mesh["tp"], hook_gradients=False)


def shard_experts(mesh: DeviceMesh, model: nn.Module, copies: Sequence[nn.Module]) -> None:
    for each in (model, *copies):
        apply_expert_parallel(each, mesh["ep"])


def shard_context(runner: MeshStepRunner, model: nn.Module) -> None:
    apply_context_parallel(model, runner.cp_group)


def layout_steps(layout: ParallelLayout, mesh: DeviceMesh, runner: MeshStepRunner, model: nn.Module,
                 model_config: ModelConfig, *, with_mtp: bool, copies: Sequence[nn.Module] = (),
                 hook_gradients: bool = True) -> dict[str, Callable[[], None]]:
    """The steps of ``layout``'s dimensions whose degree is above 1, bound to ``model`` (and its
    ``copies``), under the names :func:`transform_model` orders. ``hook_gradients`` False: the
    weights are read after sharding (the model is on the meta device now), so tensor parallelism's
    gradient hooks come later."""
    steps = {
        "pipeline": (layout.pp, partial(cut_pipeline, runner, model, model_config, with_mtp, copies)),
        "tensor": (layout.tp, partial(shard_tensor, mesh, model, model_config, layout.sequence_parallel,
                                      hook_gradients, copies)),
        "expert": (layout.ep, partial(shard_experts, mesh, model, copies)),
        "context": (layout.cp, partial(shard_context, runner, model)),
    }
    return {name: step for name, (degree, step) in steps.items() if degree > 1}
