"""``python <script or -m module> <args>`` run inside an already started (forked) interpreter: what
``make reproduce`` forks its stages with (:mod:`dsl_lit.reproduce.stage_process`) and the tests'
fork server (``tests/_zygote.py``) runs recipes with. Standard library only: the fork server loads
this file by path, so that nothing of the package is imported before the recipe it runs."""

from __future__ import annotations

import atexit
import os
import random
import runpy
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn


def run_as_main(argv: Sequence[str], extra_path: Sequence[str] = ()) -> int:
    """``python argv...`` in this (forked) process: its exit status. The interpreter's unseeded
    generators are reseeded (a fork inherits its parent's state), ``extra_path`` follows the script's
    directory on ``sys.path``."""
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    argv = list(argv)
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]
            sys.path[:1] = [os.getcwd(), *extra_path]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            sys.path[:1] = [os.path.dirname(os.path.abspath(argv[0])), *extra_path]
            runpy.run_path(argv[0], run_name="__main__")
        return 0
    except SystemExit as error:
        if error.code is None or isinstance(error.code, int):
            return error.code or 0
        print(error.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 (the recipe's traceback, as python prints it)
        traceback.print_exc()
        return 1


def exit_process(status: int) -> NoReturn:
    """End a forked child as an interpreter ends: exit handlers, flushed output, ``status``."""
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(status)
