"""The cores of a reproduction shared out among the stages that run at once.

The runner starts every stage whose inputs are finished, each in a process of its own, so
independent stages overlap (the ablations and the context base beside the R1 chain). Each recipe
run a stage starts first takes one of ``count`` slots (``reproduce.concurrent_runs``) and runs on
cores / count threads; a free slot goes to the waiting run of the highest priority (the stages
most others wait on), so the longest chain never queues behind a leaf stage's runs.

The slots live in shared memory made before the stage processes fork from the runner: a lock and
a few arrays, polled by the stages' loops (they already poll their children every 0.1 s), so a
waiting stage still hears SIGTERM and withdraws.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

CELLS = 64
"""At most this many stages wait for, or hold, slots at once."""


class CoreSlots:
    """``count`` slots, shared by the processes forked after it is made; each claimant is an
    ``owner`` number (the runner gives each stage its own, before its process starts).

    A stage keeps the slot of its last run when it has no other running (it is about to end or to
    start its next run); the runner takes it back when the stage's process ends, after it has
    registered the claims of the stages that end makes ready, so a waiting run of lower priority
    cannot slip into the gap between a chain's stages."""

    def __init__(self, count: int, context: Any = None) -> None:
        if count < 1:
            raise ValueError(f"core slots: count={count} must be at least 1")
        context = context or multiprocessing.get_context("fork")
        self.count = count
        self._lock = context.Lock()
        self._free = context.RawValue("i", count)
        self._waiting = context.RawArray("i", CELLS)  # owner of each waiting claim, 0: an empty cell
        self._priorities = context.RawArray("i", CELLS)
        self._holders = context.RawArray("i", CELLS)  # owner of each holder
        self._held = context.RawArray("i", CELLS)  # slots it holds

    def threads(self) -> int | None:
        """``OMP_NUM_THREADS`` of each run: the cores over the slots (None, the recipes' own, with one slot)."""
        return max(1, (os.cpu_count() or 1) // self.count) if self.count > 1 else None

    def claim(self, owner: int, priority: int) -> None:
        """Register that ``owner`` (a stage about to start) will want a slot at ``priority``."""
        with self._lock:
            self._register(owner, priority)

    def try_take(self, owner: int, priority: int) -> bool:
        """A slot for ``owner``'s next run if one is free and no waiting claim outranks it; else
        the claim stays registered (so a lower one cannot pass it) and the caller polls again."""
        with self._lock:
            cell = self._register(owner, priority)
            if self._free.value < 1:
                return False
            if priority < max(p for k, p in enumerate(self._priorities) if self._waiting[k]):
                return False
            self._waiting[cell] = 0
            self._free.value -= 1
            holder = self._find(self._holders, owner)
            if holder is None:
                holder = self._empty(self._holders)
                self._holders[holder] = owner
            self._held[holder] += 1
            return True

    def held(self, owner: int) -> int:
        """Slots ``owner`` holds."""
        with self._lock:
            holder = self._find(self._holders, owner)
            return 0 if holder is None else self._held[holder]

    def give_back(self, owner: int) -> None:
        """One of ``owner``'s slots, free for the next waiting claim."""
        with self._lock:
            holder = self._find(self._holders, owner)
            if holder is None or self._held[holder] < 1:
                raise RuntimeError("core slots: a slot given back that was never taken")
            self._release(holder, 1)

    def outranked(self, priority: int) -> bool:
        """A claim above ``priority`` waits: a stage with more runs to start yields its slot to it."""
        with self._lock:
            return any(self._waiting[k] and p > priority for k, p in enumerate(self._priorities))

    def withdraw(self, owner: int) -> None:
        """``owner`` no longer waits (stopped or failed)."""
        with self._lock:
            cell = self._find(self._waiting, owner)
            if cell is not None:
                self._waiting[cell] = 0

    def reclaim(self, owner: int) -> None:
        """What an ended stage held or waited for, free again (the runner, when its process ends)."""
        with self._lock:
            cell = self._find(self._waiting, owner)
            if cell is not None:
                self._waiting[cell] = 0
            holder = self._find(self._holders, owner)
            if holder is not None:
                self._release(holder, self._held[holder])

    @property
    def free(self) -> int:
        return self._free.value

    def _register(self, owner: int, priority: int) -> int:
        if owner < 1:
            raise ValueError(f"core slots: owner={owner} must be at least 1 (0 marks an empty cell)")
        cell = self._find(self._waiting, owner)
        if cell is None:
            cell = self._empty(self._waiting)
            self._waiting[cell] = owner
        self._priorities[cell] = priority
        return cell

    def _release(self, holder: int, slots: int) -> None:
        self._held[holder] -= slots
        self._free.value += slots
        if self._held[holder] == 0:
            self._holders[holder] = 0

    @staticmethod
    def _find(cells: Any, owner: int) -> int | None:
        for index, value in enumerate(cells):
            if value == owner:
                return index
        return None

    @classmethod
    def _empty(cls, cells: Any) -> int:
        index = cls._find(cells, 0)
        if index is None:
            raise RuntimeError(f"core slots: more than {CELLS} stages at once")
        return index
