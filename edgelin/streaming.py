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
import json
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


SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
MAX_HEADER = 100 << 20  # bytes: safetensors' own bound on a header


class SafetensorsReader:
    """One safetensors file read a tensor at a time with plain reads into a tensor of its own: no mapping of the file
    (safetensors' reader maps the whole file copy-on-write for torch, which a data limit such as ``RLIMIT_DATA``
    counts as the file's size). ``get_tensor(name)`` as ``safetensors.safe_open``'s; ValueError for a file that is
    not one."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.file = open(self.path, "rb")
        try:
            head = self.file.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < n <= MAX_HEADER:
                raise ValueError("its header length is not that of a safetensors file")
            header = json.loads(self.file.read(n).decode("utf-8"))
            if not isinstance(header, dict):
                raise ValueError("its header is not a JSON object")
        except (ValueError, UnicodeDecodeError):
            self.file.close()
            raise
        header.pop("__metadata__", None)
        self.start, self.header = 8 + n, header

    def keys(self) -> list[str]:
        return list(self.header)

    def get_tensor(self, name: str) -> torch.Tensor:
        try:
            info = self.header[name]
            dtype, shape, (begin, end) = SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"its header does not describe tensor {name} (dtype, shape, data_offsets)") from None
        out = torch.empty(shape, dtype=dtype)
        nbytes = out.numel() * out.element_size()
        if end - begin != nbytes:
            raise ValueError(f"tensor {name} holds {end - begin} bytes, its dtype and shape say {nbytes}")
        self.file.seek(self.start + begin)
        if nbytes and self.file.readinto(memoryview(out.view(-1).view(torch.uint8).numpy())) != nbytes:
            raise ValueError(f"the file ends inside tensor {name}")
        return out

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> "SafetensorsReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def header_shapes(file: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors file's header, read with ``SafetensorsReader`` (no mapping of the file);
    CheckpointError for a file that is not one."""
    from edgelin.errors import CheckpointError

    try:
        with SafetensorsReader(file) as reader:
            return {name: tuple(info["shape"]) for name, info in reader.header.items()}
    except (OSError, ValueError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{file} is not a readable safetensors file ({exc})") from None


def value_counts(files) -> Iterator[tuple[str, Path, int]]:
    """(tensor name, file, number of values) of every tensor in safetensors ``files``, from their headers only."""
    for file in files:
        for name, shape in header_shapes(file).items():
            count = 1
            for d in shape:
                count *= int(d)
            yield name, Path(file), count


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


def place_parameters(model: nn.Module, tensors: Iterator[tuple[str, torch.Tensor]], folder: Path | None) -> None:
    """Give ``model``'s parameters (on the meta device, from ``weightless_copy``) their values, one tensor at a time:
    an ``nn.Parameter`` given is shared as it is (no copy: another model's weight); any other tensor is written to a
    scratch file in ``folder`` and mapped (``map_parameters``), or, with ``folder`` None, kept in memory as float32."""
    params = dict(model.named_parameters(remove_duplicate=False))
    slots = tied_slots(model)

    def put(name: str, new: nn.Parameter) -> None:
        for module, attr, _ in slots[id(params[name])]:
            module._parameters[attr] = new

    def rest() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in tensors:
            if isinstance(tensor, nn.Parameter):
                put(name, tensor)
            elif folder is None:
                put(name, nn.Parameter(tensor.detach().to(torch.float32).contiguous(), requires_grad=False))
            else:
                yield name, tensor

    if folder is None:
        for _ in rest():
            pass
    else:
        map_parameters(model, rest(), folder)


def weightless_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters are on the meta device (no memory, no values; ``place_parameters``
    gives them theirs); buffers, hooks and every other attribute copied as ``copy.deepcopy`` copies them."""
    import copy

    memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad) for p in model.parameters()}
    return copy.deepcopy(model, memo)


def meta_parameters(model: nn.Module) -> list[str]:
    """Names of ``model``'s parameters still on the meta device (no values)."""
    return [n for n, p in model.named_parameters() if p.device.type == "meta"]


def build_mapped(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()``'s model with its parameters on the meta device and its buffers real (``parameters_on_meta``); a
    model whose construction computes from its parameters (a buffer made from random features) cannot be built so:
    it is built as usual, its parameters in memory until ``map_parameters`` replaces them."""
    try:
        with parameters_on_meta():
            model = build()
    except (RuntimeError, NotImplementedError):
        return build()
    if any(b.device.type == "meta" for b in model.buffers()):
        return build()
    return model


__all__ = ["SCRATCH_FILE", "SafetensorsReader", "header_shapes", "active", "build_mapped", "map_parameters", "mapped_weights", "meta_parameters", "parameters_on_meta", "place_parameters", "tied_slots", "value_counts", "weightless_copy"]
