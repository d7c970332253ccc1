"""Whether ``precision=auto``'s rule (bf16 where the CPU has AMX or AVX512-BF16) picks the faster
dtype on this machine: the rule's decision beside a measured bf16/fp32 GEMM speed ratio.

    .venv/bin/python -m benchmarks.precision_auto

The rule is read from the instruction set so that a run decides the same way every time and on
every rank; this script is where it is checked against the clock (AMX Xeon: 5-6x at 1024^2, so
bf16; a CPU without native bf16: below 1x, so fp32).
"""

from __future__ import annotations

import argparse

from benchmarks.headline import headline
from dsl_lit.precision.auto import BF16_FASTER_FROM, decide, native_bf16
from dsl_lit.precision.gemm_speed import bf16_speedup
from dsl_lit.utils.machine import machine_description


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(machine_description())
    native = native_bf16("cpu")
    speedup = bf16_speedup("cpu", size=args.size, rounds=args.rounds)
    rule, clock = decide(native), "bf16" if speedup >= BF16_FASTER_FROM else "fp32"
    print(f"native bf16: {', '.join(native) or 'none'}; rule: {rule}; bf16 GEMM at {speedup:.2f}x fp32: {clock}")
    headline("precision=auto: bf16/fp32 GEMM speed (rule picks " + rule + ")", speedup, "x",
             f"rule agrees with the clock (bf16 from {BF16_FASTER_FROM}x): {'yes' if rule == clock else 'NO'}")
    if rule != clock:
        raise SystemExit(f"precision=auto's rule picks {rule}, the clock says {clock}")


if __name__ == "__main__":
    main()
