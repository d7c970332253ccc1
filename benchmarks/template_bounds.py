"""How long a hostile chat template runs before the sandbox stops it, as a user runs it (no
tracemalloc): every payload of ``tests/unit/data_contract/test_template_bounds.py``, the slowest printed.

    .venv/bin/python -m benchmarks.template_bounds

The tests assert which bound stops each payload (steps, sizes, the deadline) with the clock switched
off, so they do not depend on the machine's speed; this script is where the speed is held to its goal:
each payload refused within 1.5 s on a 2-core CPU (the step bound, 1,000,000 steps, is sized for that;
the 5 s deadline catches a machine slower than that).
"""

from __future__ import annotations

import time

from benchmarks.headline import headline
from data_contract.errors import ConfigError
from dsl_lit.utils.machine import machine_description
from tests.unit.data_contract.test_template_bounds import PAYLOADS, _render


def main() -> None:
    print(machine_description())
    seconds = {}
    for name, (template, _) in PAYLOADS.items():
        start = time.perf_counter()
        try:
            _render(template)
        except ConfigError:
            seconds[name] = time.perf_counter() - start
        else:
            raise SystemExit(f"{name}: rendered without being refused")
    slowest = sorted(seconds.items(), key=lambda kv: -kv[1])
    print("slowest: " + ", ".join(f"{name} {s:.2f} s" for name, s in slowest[:5]))
    headline(f"template bounds: slowest payload refused ({slowest[0][0]})", slowest[0][1], "s", "< 1.5 s")


if __name__ == "__main__":
    main()
