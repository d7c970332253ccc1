"""``trainer.compile``: each transformer block compiled on its own, after every other transform.

Why per block (as torchtitan does): the blocks of a model are alike, so one compiled graph serves
them all (nn modules are inlined, their parameters are graph inputs) and compile time does not
grow with depth; what lies between blocks (embedding, the pipeline schedule, the loss, expert
all-to-all hooks) stays eager. Why last: the FP8 swap and activation recompute
(``CausalLMModule.configure_model``), then the pipeline cut and tensor / expert / context
sharding (``DeepSeekStrategy.configure_ddp``) must already be in the module the compiler traces;
``on_fit_start`` runs after both. ``nn.Module.compile`` compiles in place, so parameter names and
checkpoint keys stay those of the eager model (no ``_orig_mod.`` prefix).
"""

from __future__ import annotations

import logging

import lightning as L
from torch import nn

log = logging.getLogger(__name__)


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks this rank holds: the main layers and the MTP modules (a pipeline stage keeps
    only its own)."""
    blocks: list[nn.Module] = []
    for name in ("layers", "mtp"):
        container = getattr(model, name, None)
        if isinstance(container, nn.ModuleDict):
            blocks.extend(container.values())
    return blocks


def compile_blocks(model: nn.Module) -> int:
    """Compile each block of ``model`` in place (``torch.compile`` defaults: inductor, graph breaks
    allowed where routing has data-dependent shapes); returns how many."""
    blocks = transformer_blocks(model)
    for block in blocks:
        block.compile()
    return len(blocks)


class CompileBlocks(L.Callback):
    """Compiles the LightningModule's ``model`` block by block when fitting starts."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        n = compile_blocks(pl_module.model)
        log.info("trainer.compile: %d transformer blocks compiled (torch.compile, per block)", n)
