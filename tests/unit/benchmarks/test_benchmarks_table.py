"""``python -m benchmarks`` collects each benchmark's headline lines into one table."""

from __future__ import annotations

from benchmarks.__main__ import BENCHMARKS
from benchmarks.headline import headline, parse
from dsl_lit.utils.machine import cpu_description


def test_a_headline_reads_back(capsys):
    headline("V3 train step vs transformers, fp32", 1.23456, "x", ">= 1.5x")
    line = capsys.readouterr().out
    assert parse(line) == ("V3 train step vs transformers, fp32", "1.235", "x", ">= 1.5x")
    assert parse("max |logits ours - transformers| = 1e-6") is None


def test_every_listed_benchmark_reports_a_headline():
    from pathlib import Path

    root = Path(__file__).resolve().parents[3] / "benchmarks"
    for module, _ in BENCHMARKS:
        assert "headline(" in (root / f"{module}.py").read_text(), module
    assert "native bf16:" in cpu_description()
