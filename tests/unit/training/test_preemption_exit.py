"""Leaving after a preemption or a bad-step stop (the CI failure of the 4-rank preemption test: a
launcher SIGTERMs the ranks still running once the first exits; rank 0, still tearing down, lost
its resume line). Two real gloo ranks under a launcher that does what torchrun's agent does."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import ROOT

RANK = """
import os, sys, time
import torch.distributed as dist
from dsl_lit.training.callbacks.preemption import exit_together
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2)
if rank == 0:
    time.sleep(3)  # a slow teardown (checksums, a logger's flush)
    print("rank 0: resume line", flush=True)
elif sys.argv[1] == "peer_gone":
    os._exit(0)  # a rank that died without reaching the exit
exit_together(143)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path: Path, case: str, terminate_rest: bool = True) -> tuple[list[int], list[str]]:
    """Start both ranks; once the first exits, SIGTERM the other (torchrun's agent) unless not
    ``terminate_rest``."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, case], env={**env, "RANK": str(r)},
                              stdout=logs[r].open("w"), stderr=subprocess.STDOUT) for r in range(2)]
    deadline = time.monotonic() + 120
    while all(p.poll() is None for p in ranks):
        assert time.monotonic() < deadline, "no rank exited"
        time.sleep(0.02)
    for p in ranks:
        if terminate_rest and p.poll() is None:
            p.send_signal(signal.SIGTERM)
    codes = [p.wait(timeout=60) for p in ranks]
    return codes, [log.read_text() for log in logs]


def test_no_rank_leaves_before_the_others_so_a_launchers_sigterm_kills_none(tmp_path):
    codes, logs = _launch(tmp_path, "together")
    # without the wait, rank 1 exits at once and the launcher's SIGTERM kills rank 0 (-15) mid-teardown
    assert codes == [143, 143], logs
    assert "rank 0: resume line" in logs[0]


def test_a_peer_that_is_already_gone_does_not_keep_a_rank(tmp_path):
    codes, logs = _launch(tmp_path, "peer_gone", terminate_rest=False)
    assert codes[0] == 143, logs
    assert "not every rank reached the exit" in logs[0]


def test_after_an_agreed_stop_the_recording_handler_stays_through_the_teardown():
    """Lightning's own handler broadcasts from inside the signal handler: a launcher's SIGTERM
    during the teardown must not reach it. Any other exception hands SIGTERM back to Lightning."""
    import lightning as L
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from dsl_lit.training.callbacks.preemption import PreemptionHandler

    before = signal.getsignal(signal.SIGTERM)
    try:
        trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False)
        stopped, failed = PreemptionHandler(), PreemptionHandler()
        stopped.on_train_start(trainer, None)
        os.kill(os.getpid(), signal.SIGTERM)  # recorded, nothing more: this process lives on
        time.sleep(0.01)
        assert stopped.signalled
        stopped.on_exception(trainer, None, SIGTERMException())
        assert signal.getsignal(signal.SIGTERM) == stopped._on_sigterm
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher's, during the teardown

        failed.on_train_start(trainer, None)
        failed.on_exception(trainer, None, RuntimeError("a bad batch"))
        assert signal.getsignal(signal.SIGTERM) == stopped._on_sigterm  # what was there before it
    finally:
        signal.signal(signal.SIGTERM, before)
