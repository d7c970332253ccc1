"""What a run is, said once at start-up and written where it is kept: the resolved model (every field
its family reads, not only the preset's name), its parameter counts, the parallel layout and the
precision.

Hydra composes ``model: {name: <preset>}`` plus the ``+model.<field>=`` overrides; the preset's fields
live in Python (``src/dsl_lit/config/families/<family>.py``) and are filled in when ``TrainConfig``
validates. :func:`resolved_view` is the run's resolved config with that model written out field by
field and a ``derived`` section (parameter counts, layout, precision: computed, not settings). It is
what ``resolved_config.yaml`` and the W&B config hold; the checkpoints' ``config.yaml`` keeps the
config as composed (what resuming compares and rebuilds from). :func:`startup_lines` is the block
the run logs before its data is prepared.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dsl_lit.config import ModelConfig, TrainConfig


def model_fields(model: ModelConfig) -> dict[str, Any]:
    """Every field of the resolved model that its family reads (``name`` and ``family`` first), as
    plain values; ``extra`` only when set."""
    values = dataclasses.asdict(model)
    unused = set(model.unused_fields())
    ordered = {"name": values.pop("name"), "family": values.pop("family")}
    for key, value in values.items():
        if key in unused or (key == "extra" and not value):
            continue
        ordered[key] = value
    return ordered


_COUNTS: dict[str, dict[str, int]] = {}
"""Parameter counts per model (its fields' repr): the start-up block and the saved config share one count."""


def parameter_counts(model: ModelConfig) -> dict[str, int]:
    """``total`` (the main model, as papers quote it: embeddings once, MTP modules left out),
    ``activated_per_token`` (only the routed experts a token uses), ``mtp`` (the MTP modules')."""
    key = repr(dataclasses.asdict(model))
    if key not in _COUNTS:
        import torch

        from dsl_lit.models import build_model

        with torch.device("meta"):  # shapes only: no memory, about a second for the largest presets
            transformer = build_model(model)
        total = transformer.num_params()
        _COUNTS[key] = {"total": total, "activated_per_token": transformer.num_params(activated=True),
                        "mtp": transformer.num_params(include_mtp=True) - total}
    return dict(_COUNTS[key])


def derived(cfg: TrainConfig) -> dict[str, Any]:
    """What the config implies and no key sets: parameter counts, the layout of the processes, the
    device type and the precision the run trains in (``auto`` resolved), whether blocks are compiled."""
    from dsl_lit.training.run_plan import run_plan  # imported here: it loads torch, this module does not

    layout = dataclasses.asdict(cfg.layout) if cfg.layout is not None else {"world_size": cfg.world_size}
    plan = run_plan(cfg)
    precision = plan.precision
    return {
        "parameters": parameter_counts(cfg.model),
        "layout": layout,
        "device": plan.device_type,
        "precision": precision.name if precision.fp8 is None else f"{precision.name} + fp8 {precision.fp8}",
        "compile": plan.compile,
    }


def resolved_view(cfg: TrainConfig) -> dict[str, Any]:
    """``cfg.raw`` with ``model`` as resolved (:func:`model_fields`) and a ``derived`` section: what
    ``resolved_config.yaml`` and the W&B config hold."""
    view = {key: (model_fields(cfg.model) if key == "model" else value) for key, value in cfg.raw.items()}
    view.setdefault("model", model_fields(cfg.model))
    view["derived"] = derived(cfg)
    return view


def millions(count: int) -> str:
    """``7.10M``, ``671.0B``: a parameter count as people quote it."""
    return f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.2f}M"


def layout_text(layout: dict[str, Any]) -> str:
    """``2 processes: dp=2 tp=1 pp=1 ep=1 cp=1, zero1``."""
    world = layout.get("world_size", 1)
    degrees = " ".join(f"{k}={layout[k]}" for k in ("dp", "tp", "pp", "ep", "cp") if k in layout)
    flags = [name for name in ("zero1", "sequence_parallel") if layout.get(name)]
    if layout.get("pp", 1) > 1:
        flags.append(f"{layout.get('pp_schedule')} schedule, {layout.get('pp_virtual_stages')} virtual stage(s)")
    return f"{world} process{'es' if world != 1 else ''}: {degrees}" + "".join(f", {f}" for f in flags)


def startup_lines(cfg: TrainConfig, info: dict[str, Any] | None = None) -> list[str]:
    """The start-up block: the model's fields, its parameter counts, the layout and the precision
    (``info``: :func:`derived`, computed if not given)."""
    info = info or derived(cfg)
    fields = model_fields(cfg.model)
    name, family = fields.pop("name"), fields.pop("family")
    params = info["parameters"]
    counts = f"{millions(params['total'])} total, {millions(params['activated_per_token'])} activated per token"
    if params["mtp"]:
        counts += f" (+{millions(params['mtp'])} in {cfg.model.mtp_modules} MTP module(s))"
    return [
        f"model {name} (family {family}): {counts}",
        "  " + " ".join(f"{key}={value}" for key, value in fields.items()),
        f"layout {layout_text(info['layout'])} on {info['device']}; precision {info['precision']}, "
        f"compile {'on' if info['compile'] else 'off'}",
        f"run dir {cfg.run_dir}",
    ]
