"""The stages ``stages=[...]`` names, one file each: a ``Stage`` subclass with its settings
dataclass and the functions that run its steps' units (plus ``ingest`` and ``finalize``, which
every run starts and ends its document stages with). Registered in ``data_pipeline/registry.py``.
"""
