"""Sharded tensors of a checkpoint through ``torch.distributed.checkpoint`` (DCP), stored as safetensors.

A Lightning checkpoint dict mixes tensors (weights, optimizer moments, EMA) with small plain values
(loop counters, scheduler, data position). The tensors go to DCP: every rank writes the shards it
holds (tensor-parallel and expert-parallel DTensors as their local pieces, pipeline stages their own
layers, replicated tensors once across ranks), and a later run with another layout reads back exactly
the pieces its own tensors need. The plain values go to one small file written by rank 0.

Why DCP's Hugging Face storage rather than its default ``.distcp`` files: the default format's
``.metadata`` is a pickle, and unpickling a downloaded checkpoint can run code. Here every shard is a
safetensors file whose header carries the shard's offsets in the full tensor, so reading a
checkpoint never unpickles anything (the plain values are read with ``torch.load(weights_only=True)``).

Keys are the paths of the tensors in the checkpoint dict joined by ``/``, e.g.
``state_dict/model.layers.0.attention.wq.weight`` or
``optimizer_states/0/state/model.embed.weight/exp_avg``.
"""

from __future__ import annotations

import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

SEP = "/"
TENSOR = "<tensor>"
"""Stands in the plain part of a checkpoint where a tensor was (lists keep their positions)."""


def split_tensors(obj: Any, prefix: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """``obj`` without its tensors (each replaced by :data:`TENSOR`) and the tensors by path."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            tensors[path] = value
            return TENSOR
        if isinstance(value, dict):
            return type(value)((k, walk(v, f"{path}{SEP}{k}" if path else str(k))) for k, v in value.items())
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(walk(v, f"{path}{SEP}{i}" if path else str(i)) for i, v in enumerate(value))
        return value

    return walk(obj, prefix), tensors


def drop_tensor_markers(obj: Any) -> Any:
    """The plain part with the :data:`TENSOR` entries of dicts removed (another rank's tensors)."""
    if isinstance(obj, dict):
        return type(obj)((k, drop_tensor_markers(v)) for k, v in obj.items() if not (isinstance(v, str) and v == TENSOR))
    if isinstance(obj, list):
        return [drop_tensor_markers(v) for v in obj]
    return obj


def insert_tensors(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Put tensors back at their paths (creating the dicts on the way), in place; returns ``obj``."""
    for path, tensor in tensors.items():
        *parents, last = path.split(SEP)
        node = obj
        for key in parents:
            if isinstance(node, list):
                node = node[int(key)]
            else:
                node = node.setdefault(key, {})
        if isinstance(node, list):
            node[int(last)] = tensor
        else:
            node[last] = tensor
    return obj


def plain_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as the plain ``torch.Tensor`` it wraps (the same storage), if it is a weight wrapper.

    Why: torchao's FP8 training of the routed experts (``precision.fp8.apply_fp8``, torchao backend)
    keeps each expert weight as a ``Float8TrainingWeightWrapperTensor``: a tensor subclass holding
    the fp32/bf16 master weight as its one inner tensor, which only changes how matmuls dispatch.
    The model's state dict (and an EMA's copies of it) hands those wrappers over, and a synchronous
    save failed on them: safetensors asks the wrapper for a storage it does not have ("Attempted to
    access the data pointer on an invalid python storage"; an asynchronous save passed only because
    DCP's CPU staging copies happen to come out plain). So the inner tensor is written, under the
    same name: the checkpoint loads into a plain model, an FP8 one, or the HF export alike (reading
    into an FP8 model's wrapper copies into its inner tensor, the weight). Only a wrapper of exactly
    one inner tensor of its own shape and dtype is unwrapped; any other subclass (an FP8 tensor of
    data and scales) raises TypeError. DTensors are left to DCP, which writes their local shards.
    """
    while is_traceable_wrapper_subclass(tensor) and not isinstance(tensor, DTensor):
        names, _ = tensor.__tensor_flatten__()
        inner = getattr(tensor, names[0]) if len(names) == 1 else None
        if not isinstance(inner, torch.Tensor) or inner.shape != tensor.shape or inner.dtype != tensor.dtype:
            raise TypeError(
                f"cannot checkpoint a {type(tensor).__name__} of shape {tuple(tensor.shape)} and dtype "
                f"{tensor.dtype}: it does not wrap one tensor of its own shape and dtype (inner: {names})"
            )
        tensor = inner
    return tensor


def plain_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """:func:`plain_tensor` of each value."""
    return {key: plain_tensor(value) for key, value in tensors.items()}


def _quiet_single_process() -> None:
    """DCP warns on every single-process call that it assumes one process; here that is intended."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def _no_dist(process_group: dist.ProcessGroup | None) -> bool:
    """Whether this is one process without a process group (DCP's ``no_dist``)."""
    no_dist = process_group is None and not (dist.is_available() and dist.is_initialized())
    if no_dist:
        _quiet_single_process()
    return no_dist


def save_shards(
    tensors: dict[str, torch.Tensor], directory: Path, process_group: dist.ProcessGroup | None = None,
    asynchronous: bool = False,
) -> Future | None:
    """Every rank writes its shards of ``tensors`` under ``directory`` (a collective over
    ``process_group``). Asynchronous: the tensors are first copied to CPU memory (so training may
    change them), then written by a background thread; returns the future of that write."""
    tensors = plain_tensors(tensors)  # torchao's FP8 expert weights are wrappers (plain_tensor)
    writer = HuggingFaceStorageWriter(str(directory), save_distributed=True)
    no_dist = _no_dist(process_group)
    if asynchronous:
        return dcp.async_save(tensors, storage_writer=writer, process_group=process_group, no_dist=no_dist)
    dcp.save(tensors, storage_writer=writer, process_group=process_group, no_dist=no_dist)
    return None


def saved_tensors(directory: Path) -> dict[str, TensorStorageMetadata]:
    """Name -> full size and dtype of every tensor saved under ``directory`` (from the safetensors headers)."""
    metadata = HuggingFaceStorageReader(str(directory)).read_metadata()
    return dict(metadata.state_dict_metadata)


def missing_tensors(template: dict[str, torch.Tensor], directory: Path) -> list[str]:
    """The keys of ``template`` that the checkpoint under ``directory`` lacks (read from the
    safetensors headers only); ValueError for a tensor saved with another shape."""
    saved = saved_tensors(directory)
    for key, tensor in template.items():
        if key in saved and tuple(tensor.shape) != tuple(saved[key].size):
            raise ValueError(
                f"{key} has shape {tuple(saved[key].size)} in the checkpoint but {tuple(tensor.shape)} in this run"
            )
    return [k for k in template if k not in saved]


def load_shards(
    template: dict[str, torch.Tensor], directory: Path, process_group: dist.ProcessGroup | None = None,
) -> None:
    """Fill the tensors of ``template`` in place (DTensors get just their shards) from ``directory``,
    which holds every one of them (:func:`missing_tensors` says which it lacks). A collective: an
    error on any rank raises DCP's ``CheckpointException`` on every rank."""
    dcp.load(template, storage_reader=HuggingFaceStorageReader(str(directory)), planner=DefaultLoadPlanner(),
             process_group=process_group, no_dist=_no_dist(process_group))


def read_full_tensors(directory: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Whole tensors (shards assembled) whose key starts with ``prefix``, on this one process, prefix
    removed: for tools that read a checkpoint without the training layout (export, inspection)."""
    template = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in saved_tensors(directory).items() if key.startswith(prefix)
    }
    if template:
        _quiet_single_process()
        dcp.load(template, storage_reader=HuggingFaceStorageReader(str(directory)), no_dist=True)
    return {key[len(prefix):]: value for key, value in template.items()}
