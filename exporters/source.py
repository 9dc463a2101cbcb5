"""The model to export: a checkpoint's loaded, or a module checked against the model protocol; its weights finite,
its epsilons ones the graph keeps, and the chunk size asked for."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from edgelin import protocol
from edgelin.checkpoint import Checkpoint, load_checkpoint, model_sha256
from edgelin.errors import ExportError
from edgelin.runtime.memory import available_memory
from edgelin.safety import check_finite_weights
from edgelin.streaming import value_counts


def resolve_source(source, chunk_size: int | None) -> tuple[torch.nn.Module, str]:
    """(model in eval mode with the requested chunk size, sha256 of its weights as safetensors). ``source``: a model,
    or a ``Checkpoint`` (the folder read once)."""
    if isinstance(source, Checkpoint):
        model = load_checkpoint(source)
        digest = source.sha256
    else:
        protocol.check_model(source)
        model, digest = source, model_sha256(source)
    check_finite_weights(model)  # with or without the smoke check: NaN weights export silently otherwise
    _check_epsilons(model)
    if chunk_size is not None:
        if not hasattr(model, "with_chunk_size"):
            raise ExportError(f"{type(model).__name__} has no with_chunk_size(); export it without --chunk-size")
        model = model.with_chunk_size(chunk_size)
    return model.float().eval(), digest


MIN_GRAPH_EPS = 1e-7  # torch.onnx's graph optimiser folds "x + c" into "x" for a constant c <= ~1e-8


def _check_epsilons(model) -> None:
    """A LinearLM's eps / norm_eps below MIN_GRAPH_EPS would silently vanish from the exported graph (the
    optimiser treats the addition as a no-op): a zero denominator would then give NaN where PyTorch gives 0."""
    cfg = getattr(model, "cfg", None)
    for name in ("eps", "norm_eps"):
        value = getattr(cfg, name, None)
        if isinstance(value, float) and value < MIN_GRAPH_EPS:
            raise ExportError(
                f"config field {name!r} is {value:g}, below {MIN_GRAPH_EPS:g}: ONNX's graph optimiser drops such a constant "
                f"from the exported graph; use {name} >= {MIN_GRAPH_EPS:g}"
            )


def check_largest_tensor(checkpoint: Checkpoint) -> None:
    """Refuse, before any work, a checkpoint whose largest tensor cannot be held in memory: a streamed export reads
    one tensor at a time, as stored and as float32 (up to 8 bytes per value: a float32 copy of a float32 tensor), so
    that tensor alone bounds what loading needs beyond the export's own working memory."""
    if checkpoint is None or checkpoint.config_only:
        return
    largest, where = 0, ""
    for name, file, count in value_counts(checkpoint.files):
        if count > largest:
            largest, where = count, f"{name} in {file.name}"
    need, have = 8 * largest, available_memory()
    if have is not None and need > have:
        raise ExportError(f"the checkpoint's largest tensor ({where}, {largest:,} values) needs {need:,} bytes to read and "
                          f"convert, but {have:,} bytes of memory are available; export on a machine with more memory")


def _size(n: float) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"


BYTES_PER_VALUE = {"fp32": 4.0, "fp16": 2.0, "int8": 1.0, "int4": 0.5}  # the weights file's least bytes a weight


def check_disk(model: torch.nn.Module, folder: Path, precision: str) -> None:
    """Refuse, before the trace, an export whose weights file cannot fit on the disk it is written to (``folder``: the
    work folder beside the output): the model's weights at ``precision``'s bytes a value, a lower bound (scales, what
    stays in higher precision and the per-graph files before they are stored once come on top; the traced graphs'
    float32 weights are not written, ``edgelin.exporters.deferred``). Held against the space free now (a streamed
    export's scratch file is written by then)."""
    values = sum(p.numel() for p in model.parameters())  # a tied weight once
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return
    need = BYTES_PER_VALUE.get(precision, 4.0) * values
    if need > free:
        raise ExportError(f"the export's weights need at least {_size(need)} of free disk in {folder.parent} (the model's {values:,} "
                          f"weights in {precision}) and {_size(free)} are free there; make room, or export to a disk with more space")
