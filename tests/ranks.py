"""``torch.multiprocessing.spawn`` for the tests' gloo ranks, forked from a fork server.

A spawned rank is a fresh interpreter that imports torch (and, through the test module, Lightning:
~13 s here) before it runs a line of the test; the suite starts ~40 such ranks. Python's
``forkserver`` start method imports ``PRELOAD`` once, in a server process that runs no torch
operation (so no thread pool exists when it forks), and forks every rank from it: each rank is
still its own OS process with its own gloo process group, as with ``spawn``."""

from __future__ import annotations

import multiprocessing
import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed", "lightning"]


def spawn(fn: Callable[..., Any], args: tuple = (), nprocs: int = 2) -> None:
    """``mp.spawn(fn, args, nprocs, join=True)``: ``fn(rank, *args)`` in ``nprocs`` processes; raises
    the first rank's exception."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a rendezvous the test starts next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
