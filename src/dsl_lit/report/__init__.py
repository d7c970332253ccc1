"""Run reports: PNG figures of a training run drawn from its ``metrics.csv`` (``recipes/report.py``)."""
