"""Starting weights (``init_from``) of a pretraining or post-training run: one of our training
checkpoints or a Hugging Face directory, opened without reading its weights.

Why lazily: a released model (DeepSeek-V2-Lite, V3) does not fit in one process. :class:`StartingWeights`
knows the model config and has checked every name and shape against it (from the safetensors
headers alone); the weights are read later, where the model is: the whole model on one process,
or, once the strategy has pruned and sharded a model built on the meta device, only the tensors
of this rank's pipeline stages, tensor shards and experts (:meth:`StartingWeights.load`).

Our checkpoints are read through DCP (the reader of ``dsl_lit.checkpoint``: safetensors shards, any
layout that wrote them, each rank reading the pieces its tensors need); HF directories through
:class:`~dsl_lit.hf.reader.HFCheckpoint` (safetensors only, no remote code, FP8 / FP4 dequantised).
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader

from data_contract.errors import ConfigError
from dsl_lit.checkpoint.files import SHARDS
from dsl_lit.checkpoint.reader import PREFIX, find_checkpoint, model_config
from dsl_lit.checkpoint.sharded import saved_tensors
from dsl_lit.checkpoint.tokenizer import RecordedTokenizer, recorded_tokenizer
from dsl_lit.config.model import continued_config
from dsl_lit.hf.reader import CONFIG_NAME, HFCheckpoint, check_state_dict
from dsl_lit.memory.host import peak_rss_bytes
from dsl_lit.models import ModelConfig, Transformer, build_model, spec_of
from dsl_lit.models.common.hf_adapter import few
from dsl_lit.utils.materialise import local_target, materialise

log = logging.getLogger(__name__)

STATE_PREFIX = "state_dict/" + PREFIX
"""Keys of the model's tensors in our checkpoints' shards."""


def model_group(cfg: ModelConfig) -> dict[str, Any]:
    """The ``model`` config group that rebuilds ``cfg`` with ``ModelConfig.from_name``: a preset of
    the family with every field overridden (so a checkpoint of this run can be exported)."""
    values = dataclasses.asdict(cfg)
    values.pop("name")
    return {"name": spec_of(cfg).card.base_preset, **values}


@dataclasses.dataclass
class StartingWeights:
    """Weights to start from, checked against their model config but not read yet."""

    path: Path
    """An HF directory, or our ``step-<N>`` checkpoint."""
    config: ModelConfig
    group: dict[str, Any]
    """The ``model`` config group that rebuilds :attr:`config` (it replaces the run's)."""
    hf: HFCheckpoint | None
    """The opened HF directory (None: our checkpoint)."""
    added: ModelConfig | None = None
    """The architecture the run continues these weights as, when it adds modules to them
    (DeepSeek-V3.2's indexers on a DeepSeek-V3 checkpoint: :meth:`continued_as`); None: the weights' own."""

    def continued_as(self, run: ModelConfig) -> StartingWeights:
        """These weights as the start of ``run``'s model when its family continues theirs (its card's
        ``continues``: DeepSeek-V3.2 continues DeepSeek-V3, adding the lightning indexers): the
        checkpoint's architecture with ``run``'s family and the fields its card adds. The added
        tensors start from the family's initialisation (normal(0, init_std), norms one, biases zero);
        everything else is read. Unchanged when ``run``'s family does not continue theirs."""
        continued = continued_config(self.config, run)
        if continued is None:
            return self
        return dataclasses.replace(self, config=continued, group=model_group(continued), added=self.config)

    def _own_names(self) -> set[str]:
        """The state-dict names the checkpoint itself holds (all, unless the run added modules)."""
        with torch.device("meta"):
            return set(build_model(self.added or self.config).state_dict())

    @property
    def recorded_tokenizer(self) -> RecordedTokenizer | None:
        """The tokenizer our checkpoint's run trained with (None: an HF directory, or a checkpoint
        written before runs recorded theirs): :mod:`dsl_lit.checkpoint.tokenizer`."""
        return None if self.hf is not None else recorded_tokenizer(self.path)

    @classmethod
    def open(cls, path: str | Path) -> StartingWeights:
        """An HF directory (config.json), or our ``step-<N>`` checkpoint / run directory (its latest
        complete step); ConfigError if its tensors do not match its model config."""
        directory = Path(path)
        with torch.device("meta"):
            if (directory / CONFIG_NAME).is_file():
                hf = HFCheckpoint(directory)
                hf.check(build_model(hf.config).state_dict())
                return cls(directory, hf.config, model_group(hf.config), hf)
            step = find_checkpoint(directory)
            cfg = model_config(step)
            saved = {key.removeprefix(STATE_PREFIX): torch.empty(meta.size)
                     for key, meta in saved_tensors(step / SHARDS).items() if key.startswith(STATE_PREFIX)}
            check_state_dict(saved, build_model(cfg).state_dict(), what=f"init_from={path} ({step / SHARDS})")
        raw = yaml.safe_load((step / "config.yaml").read_text())
        return cls(step, cfg, dict(raw["model"]), None)

    def load(self, model: nn.Module, device: torch.device | str, dtype: torch.dtype | None = None) -> None:
        """Allocate ``model`` (built from :attr:`config` on the meta device, possibly pruned to
        pipeline stages and sharded since) on ``device`` and read into each tensor exactly the part
        this process holds. ``dtype`` None keeps the dtypes the model was built with; a dtype
        applies to the parameters (buffers such as the router's bias stay fp32, as the HF layouts
        keep them)."""
        own = self._own_names() if self.added is not None else None
        if self.hf is None:
            params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
            materialise(model, device, (lambda name: dtype if name in params else None) if dtype else None)
            if own is not None:
                initialise_added(model, own, self.config.init_std)
            template = {STATE_PREFIX + name: t for name, t in model.state_dict().items() if own is None or name in own}
            # each process reads its own pieces (no collective): DTensors take their local shards
            with warnings.catch_warnings():  # DCP warns that no_dist means one process: here, one per rank
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(template, storage_reader=HuggingFaceStorageReader(str(self.path / SHARDS)), no_dist=True)
            bad = [name.removeprefix(STATE_PREFIX) for name, t in template.items()
                   if t.is_floating_point() and not bool(torch.isfinite(local_target(t)[0]).all())]
            if bad:
                raise ConfigError(f"init_from={self.path}: {few(bad)} hold(s) NaN or inf values in "
                                  f"{self.path / SHARDS}; start from a checkpoint before the weights broke")
            read = ""
        else:
            hf = self.hf
            targets = materialise(model, device, (lambda name: hf.dtype_for(name, dtype)) if dtype else None)
            if own is not None:
                initialise_added(model, own, self.config.init_std)
                targets = {name: target for name, target in targets.items() if name in own}
            before = hf.bytes_read
            hf.fill(targets)
            read = f", read {(hf.bytes_read - before) / 2**20:.1f} MiB"
        locals_ = [local_target(t)[0] for t in {id(t): t for t in model.state_dict().values()}.values()]
        held = sum(t.numel() * t.element_size() for t in locals_)
        log.info("starting weights from %s: this process holds %.1f MiB%s; peak RSS %.1f MiB", self.path,
                 held / 2**20, read, peak_rss_bytes() / 2**20)

    def whole_model(self, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> Transformer:
        """The whole model with these weights (fp32 unless ``dtype``), on ``device``."""
        with torch.device("meta"):
            model = build_model(self.config)
        self.load(model, device, dtype)
        return model


@torch.no_grad()
def initialise_added(model: nn.Module, own: set[str], std: float) -> None:
    """Initialise the tensors of ``model`` a checkpoint does not hold (names not in ``own``): as the
    family initialises them (``Transformer.init_weights``): matrices normal(0, ``std``), 1-D weights
    (norms) one, biases zero."""
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name in own:
            continue
        if name.endswith(".bias"):
            tensor.zero_()
        elif tensor.ndim == 1:
            tensor.fill_(1.0)
        else:
            tensor.normal_(0.0, std)
    log.info("init_from: %d tensor(s) the checkpoint lacks start from the initialisation (%s)",
             sum(name not in own for name in model.state_dict()), few(sorted(set(model.state_dict()) - own)))


def load_pretrained(path: str | Path) -> tuple[Transformer, dict[str, Any]]:
    """(fp32 model with the weights, its ``model`` config group) from ``path``: an HF directory
    (config.json), or our ``step-<N>`` checkpoint / run directory (its latest complete step)."""
    weights = StartingWeights.open(path)
    return weights.whole_model(), weights.group
