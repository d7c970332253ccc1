"""How our strategies save and restore: sharded, by name, from and to any layout.

Lightning's strategies gather nothing and let rank 0 write a ``torch.save`` file. Ours hand each
rank's own part of the checkpoint (model and EMA tensors as the rank holds them, DTensors under
tensor and expert parallelism; the optimizer's moments keyed by parameter name) to
:class:`~dsl_lit.checkpoint.directory.DirectoryCheckpointIO` on every rank, which writes them as
shards with ``torch.distributed.checkpoint``. Restoring happens after the strategy set the model
up, so the checkpoint is read straight into the tensors this rank holds in *this* run's layout:
a checkpoint of any dp / tp / pp / ep / ZeRO-1 layout resumes under any other, on any world size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dsl_lit.checkpoint.directory import DirectoryCheckpointIO
from dsl_lit.checkpoint.hyperparameters import use_current_hyperparameters
from dsl_lit.parallel.optimizer_state import (
    load_named_optimizer_state,
    named_optimizer_state,
    optimizer_state_template,
)


class ShardedCheckpointing:
    """Mixin for a Lightning ``Strategy``: sharded, name-keyed, layout-independent checkpoints."""

    _checkpoint_group: dist.ProcessGroup | None = None

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # read into the set-up (sharded, pruned) model, not into a full copy first

    def _sharded_io(self) -> DirectoryCheckpointIO | None:
        io = self.checkpoint_io
        if not isinstance(io, DirectoryCheckpointIO):
            return None
        io.rank = self.global_rank
        if self.world_size > 1 and self._checkpoint_group is None:  # every rank gets here together
            self._checkpoint_group = dist.new_group(backend="gloo")  # DCP's plans travel as CPU objects
        io.process_group = self._checkpoint_group
        return io

    # -- what a checkpoint holds ------------------------------------------------------------------
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return named_optimizer_state(optimizer, self.lightning_module)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        for optimizer, named in zip(self.optimizers, checkpoint["optimizer_states"]):
            load_named_optimizer_state(optimizer, self.lightning_module, named)

    def checkpoint_template(self) -> dict[str, Any]:
        """This run's checkpoint tensors in its own layout, for the shards to be read into."""
        trainer = self.lightning_module.trainer
        return {
            "state_dict": self.lightning_module.state_dict(),
            "optimizer_states": [optimizer_state_template(o, self.lightning_module) for o in self.optimizers],
            "callbacks": {cb.state_key: cb.state_dict() for cb in trainer.callbacks},
        }

    # -- every rank writes and reads its own part ----------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        io = self._sharded_io()
        if io is None:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint, with this run's optimizer and schedule hyperparameters in place of the
        saved ones (a resume with changed settings trains with them from the resumed step)."""
        io = self._sharded_io()
        if io is None:
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        else:
            checkpoint = io.load_checkpoint(checkpoint_path, template=self.checkpoint_template())
        use_current_hyperparameters(checkpoint, self.optimizers, self.lr_scheduler_configs)
        return checkpoint
