"""A run's ``metrics.csv`` as one series per column: the reader lives beside the writer
(:mod:`dsl_lit.training.metrics_file`), so the training loop's closing summary reads it without
importing the report layer; its names are kept here for the report and reproduce code."""

from dsl_lit.training.metrics_file import (  # noqa: F401 (the public names, importable from here)
    METRICS_FILE,
    Series,
    columns_with_prefix,
    non_finite_steps,
    read_metrics,
)
