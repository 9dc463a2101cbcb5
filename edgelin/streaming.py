"""Weights that live on disk, not in memory: a checkpoint's parameters as float32 pages mapped from a scratch file.

Inside ``mapped_weights(folder)``, the weights loader (``edgelin.importers.weights.load_checkpoint_weights``) builds
the model with its parameters on torch's meta device (buffers computed from the config, such as RoPE tables, stay
real: they are small), then reads the checkpoint one tensor at a time -- renamed, split, joined and converted to
float32 as always -- and appends each to a scratch file in ``folder`` instead of copying it into the model. Once
every tensor is written, the file is memory-mapped (shared, read and write) and each parameter becomes a view of
its bytes. The file is unlinked as soon as it is mapped (where the system allows: its space is freed when the
mapping is), so nothing is left behind whatever happens next.

What that buys: the process's own (anonymous) memory holds one checkpoint tensor at a time while loading, and the
model's weights afterwards are file pages that the system reads in as the model runs and can drop again under
pressure, like a page cache. A shared mapping is not data in ``RLIMIT_DATA``'s sense (Linux counts private writable
mappings only), and an importer that scales a weight in place after loading (Falcon-H1's multipliers) writes to the
scratch file's pages, never to the checkpoint. The price is disk: the model's float32 weights once more, for as long
as the export runs.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from torch import nn

SCRATCH_FILE = ".weights.f32"  # in the folder given; unlinked once mapped
ALIGN = 4096  # each tensor starts on a page boundary

_FOLDER: list[Path] = []  # the innermost ``mapped_weights`` folder, if any


@contextlib.contextmanager
def mapped_weights(folder: str | Path) -> Iterator[None]:
    """Checkpoints loaded inside this context get their parameters mapped from a scratch file in ``folder`` (module
    docstring); outside it, the weights loader copies them into memory as before."""
    _FOLDER.append(Path(folder))
    try:
        yield
    finally:
        _FOLDER.pop()


def active() -> Path | None:
    """The folder of the innermost ``mapped_weights`` context; None outside one."""
    return _FOLDER[-1] if _FOLDER else None


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside this context register their parameters on the meta device (no memory, no values); their
    buffers are made as usual. Each parameter is made (and initialised) on the CPU first, then replaced: one
    parameter's memory at a time."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def tied_slots(model: nn.Module) -> dict[int, list[tuple[nn.Module, str, str]]]:
    """id of each parameter -> every (module, attribute, full name) that holds it (a tied embedding and head: two)."""
    slots: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is not None:
                slots.setdefault(id(param), []).append((module, attr, f"{mod_name}.{attr}" if mod_name else attr))
    return slots


def map_parameters(model: nn.Module, tensors: Iterator[tuple[str, torch.Tensor]], folder: Path) -> None:
    """Write ``tensors`` ((name in ``model``'s state dict, float32 tensor), one at a time) to a scratch file in
    ``folder``, map it, and make each named parameter a view of its bytes (every module that shares it gets the same
    Parameter); a named buffer is copied into the model as usual. A parameter that no tensor names is left as it
    is. Nothing but the tensor being written is held while writing."""
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    path = folder / SCRATCH_FILE
    placed: dict[int, tuple[int, torch.Size]] = {}  # id(parameter) -> (offset, shape)
    with open(path, "xb") as out:
        for name, tensor in tensors:
            if name in buffers:
                with torch.no_grad():
                    buffers[name].copy_(tensor)
                continue
            param = params[name]
            if id(param) in placed:
                continue
            data = tensor.detach().to(torch.float32).contiguous()
            out.write(b"\0" * (-out.tell() % ALIGN))
            placed[id(param)] = (out.tell(), data.shape)
            if data.numel():
                out.write(memoryview(data.numpy()).cast("B"))
            del data, tensor
        size = out.tell()
    if size == 0:
        path.unlink()
        return
    pages = np.memmap(path, dtype=np.uint8, mode="r+", shape=(size,))  # MAP_SHARED: not private data, writes go to the file
    with contextlib.suppress(OSError):  # Windows keeps a mapped file: it goes with the export's work folder
        os.unlink(path)
    slots = tied_slots(model)
    for pid, (offset, shape) in placed.items():
        count = int(np.prod(shape, dtype=np.int64))
        view = torch.from_numpy(pages[offset:offset + 4 * count].view(np.float32).reshape(tuple(shape)))
        first = slots[pid][0]
        new = nn.Parameter(view, requires_grad=first[0]._parameters[first[1]].requires_grad)
        for module, attr, _ in slots[pid]:
            module._parameters[attr] = new


def meta_parameters(model: nn.Module) -> list[str]:
    """Names of ``model``'s parameters still on the meta device (no values)."""
    return [n for n, p in model.named_parameters() if p.device.type == "meta"]


def build_mapped(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()``'s model with its parameters on the meta device and its buffers real (``parameters_on_meta``)."""
    with parameters_on_meta():
        return build()


__all__ = ["SCRATCH_FILE", "active", "build_mapped", "map_parameters", "mapped_weights", "meta_parameters", "parameters_on_meta", "tied_slots"]
