"""What makes a CUDA host wait, counted on CPU: in a training step (after warm-up) of the tiny V3 with
MLA, MoE and MTP, no ``.item()``/``bool(tensor)``/``float(tensor)`` (``aten._local_scalar_dense``),
no ``nonzero`` (an output whose size is data) and no copy to the host: each would stall the CPU
until the GPU had finished the step so far (clipping read the norm, the loss scaler the gradients'
finiteness, every step). The GPU twin runs the same steps under
``torch.cuda.set_sync_debug_mode("error")`` (tests/e2e/gpu/test_gpu.py)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsl_lit.optim.clip import clip_by_norm_
from tests.step_syncs import run_watched_steps

HOST_WAITS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::item"}


class HostWaits(TorchDispatchMode):
    """Counts the operators that would make a CUDA host wait for the device."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in HOST_WAITS:
            self.seen[name] = self.seen.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_training_step_waits_for_nothing(precision):
    mode = HostWaits()
    module = run_watched_steps(torch.device("cpu"), precision, watch=lambda _: mode.__enter__(),
                               unwatch=lambda _: mode.__exit__(None, None, None), checks_on_device=True)
    assert mode.seen == {}, mode.seen
    assert module.steps_applied == 5 and module.bad_steps_in_a_row == 0  # the checks were read at the last step


def test_clipping_scales_on_the_device_and_skips_non_finite():
    grads = [torch.full((3,), 3.0), torch.full((4,), 4.0)]
    norm = torch.stack([g.norm(dtype=torch.float64) for g in grads]).square().sum().sqrt()
    mode = HostWaits()
    with mode:
        out = clip_by_norm_(grads, norm, max_norm=1.0, loss_scale=2.0)
    assert mode.seen == {}
    assert float(out) == pytest.approx(float(norm) / 2)
    coef = min(1.0, 1.0 / (float(norm) / 2 + 1e-6)) / 2
    torch.testing.assert_close(grads[0], torch.full((3,), 3.0 * coef))
    bad = [torch.ones(2)]
    clip_by_norm_(bad, torch.tensor(math.inf, dtype=torch.float64), max_norm=1.0)
    assert torch.equal(bad[0], torch.ones(2))  # untouched: the step is skipped


def test_a_non_finite_step_is_skipped_on_the_device_and_counted_when_read(caplog):
    """Checks on the device: the fused AdamW leaves the weights of a step with a NaN gradient as they
    were (step 2, the one watched), and the skip is counted and logged when the checks are read."""
    seen: dict[str, dict[str, torch.Tensor]] = {}

    def poison(module):
        seen["before"] = {n: p.detach().clone() for n, p in module.model.named_parameters()}
        module.nan_hook = module.model.tok_embeddings.weight.register_hook(lambda g: g * math.nan)

    def unpoison(module):
        module.nan_hook.remove()
        seen["after"] = {n: p.detach().clone() for n, p in module.model.named_parameters()}

    module = run_watched_steps(torch.device("cpu"), "fp32", watch=poison, unwatch=unpoison, steps=4,
                               checks_on_device=True)
    for name, before in seen["before"].items():
        assert torch.equal(seen["after"][name], before), name
    assert module.steps_applied == 3 and module.loss_scaler.skipped_steps == 1
    assert "step 2 skipped: the gradient norm is non-finite" in caplog.text
