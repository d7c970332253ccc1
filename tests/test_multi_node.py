"""Two "nodes" on this machine under torchrun (static rendezvous on 127.0.0.1, one process per
node): the recipe trains with one process's losses, checkpoints, and resumes exactly. This is
the path a multi-node cluster takes (``scripts/slurm_pretrain.sh`` runs the same command per node)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_pretrain_e2e import ROOT, SMALL, losses, run_recipe

RUN = ["logger=csv", "trainer.accelerator=cpu", "checkpoint.every_n_steps=3", "checkpoint.every_minutes=0",
       "checkpoint.async_save=false"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(run_dir: Path, *overrides: str) -> None:
    """One torchrun per node, as a cluster starts them; both must exit 0."""
    port = _free_port()
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
def test_two_nodes_train_checkpoint_and_resume_like_one_process(tmp_path):
    one = tmp_path / "one"
    run_recipe(one, *RUN, "trainer.max_steps=6")
    nodes = tmp_path / "nodes"
    _two_nodes(nodes, "trainer.max_steps=3")
    assert (nodes / "checkpoints" / "step-3" / "meta.json").is_file()
    _two_nodes(nodes, "trainer.max_steps=6")  # the same command resumes from step-3
    two = losses(nodes)
    assert sorted(two) == list(range(6))
    for step, loss in losses(one).items():  # data parallel over 2 ranks: the same sums, reordered
        assert float(two[step]) == pytest.approx(float(loss), rel=1e-5 if step == 0 else 2e-3), step
