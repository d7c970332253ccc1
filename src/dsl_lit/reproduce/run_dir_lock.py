"""One ``make reproduce`` per run directory, and no stage outliving the run that started it.

Why: a SIGKILLed ``recipes/reproduce.py`` left its stage's recipe running, and a rerun started the
same stage again in the same directory (two trainings writing one checkpoint folder); two runs
given one run dir collided the same way.

* The run holds an exclusive ``flock`` on ``<run dir>/.reproduce.lock`` and hands the locked file
  to every stage it starts: the lock is released only when the run *and* its stages have exited
  (the kernel drops it with the last holder, a SIGKILL included), so a second run is refused in one
  line until then.
* Each stage is started with ``PR_SET_PDEATHSIG``: if the run dies, its stage gets a SIGTERM (it
  saves its checkpoint and exits, as on a plain SIGTERM) instead of running on unseen.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import signal
import sys
from pathlib import Path

from data_contract.errors import ConfigError

LOCK_FILE = ".reproduce.lock"
PR_SET_PDEATHSIG = 1


def hold_run_dir(run_dir: Path) -> int:
    """Lock ``run_dir`` for this run; returns the lock's file descriptor (inheritable, so that the
    stages hold it too). ConfigError naming the holder when another run has it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(f"another make reproduce (pid {holder}) or one of its stages is running in {run_dir}; wait "
                          "for it to finish (or stop it), or give this run another run_name") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    os.set_inheritable(fd, True)
    return fd


def die_with_parent() -> None:
    """``preexec_fn`` of a stage: a SIGTERM when the run that started it dies (Linux; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
