"""Two "nodes" on this machine under torchrun (static rendezvous on 127.0.0.1, one process per
node): the recipe resumes, trains with one process's losses and checkpoints. This is
the path a multi-node cluster takes (``scripts/slurm_pretrain.sh`` runs the same command per node)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.ranks import free_port
from tests.recipe_runs import SMALL, losses, run_recipe

RUN = ["logger=csv", "trainer.accelerator=cpu", "checkpoint.every_n_steps=3", "checkpoint.every_minutes=0",
       "checkpoint.async_save=false"]


def _two_nodes(run_dir: Path, *overrides: str) -> None:
    """One torchrun per node, as a cluster starts them; both must exit 0."""
    port = free_port()
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", f"--node-rank={rank}",
             "--master-addr=127.0.0.1", f"--master-port={port}", str(ROOT / "recipes" / "pretrain.py"), *SMALL, *RUN,
             "trainer.num_nodes=2", "trainer.devices=1", f"hydra.run.dir={run_dir}", *overrides],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    for rank, (node, output) in enumerate(zip(nodes, outputs)):
        assert node.returncode == 0, f"node {rank}: {output[-3000:]}"


@pytest.mark.slow
def test_two_nodes_resume_train_and_checkpoint_like_one_process(tmp_path):
    """One launch of two nodes (each torchrun start costs two fresh interpreters here): they resume a
    one-process checkpoint (step 3), train to step 6 with one process's losses and save step 6,
    which one process then resumes: a checkpoint crosses the node boundary both ways."""
    one = tmp_path / "one"
    run_recipe(one, *RUN, "trainer.max_steps=7")
    nodes = tmp_path / "nodes"
    run_recipe(nodes, *RUN, "trainer.max_steps=3")
    _two_nodes(nodes, "trainer.max_steps=6")  # the same command resumes from step-3
    assert (nodes / "checkpoints" / "step-6" / "meta.json").is_file()
    run_recipe(nodes, *RUN, "trainer.max_steps=7")
    two, reference = losses(nodes), losses(one)
    assert sorted(two) == list(range(7))
    assert [two[s] for s in range(3)] == [reference[s] for s in range(3)]  # one process both times
    for step in range(3, 7):  # data parallel over 2 nodes from step 3: the same sums, reordered
        assert float(two[step]) == pytest.approx(float(reference[step]), rel=2e-3), step
