"""A model run with its weights converted one layer at a time: the float64 reference without a float64 copy.

``converted(model, convert)`` is a context inside which ``model`` computes with ``convert`` applied to its floating
parameters and buffers (``torch.Tensor.double``: the float64 model), as ``copy.deepcopy(model).double()`` would, but
with no copy of the model: the weights outside the layers (embedding, final norm, head) and every buffer are
converted on entry; each layer's (``model.blocks[i]``) are converted as that layer starts and let go as it returns.
On exit the model holds exactly the tensors it held before. So the converted weights in memory at any time are those
outside the layers plus one layer's, whatever the model's depth; a model whose weights are mapped from disk
(``edgelin.streaming``) stays mapped, its pages read once per pass.

``Converted`` (the model as a float64 model, call after call) keeps the conversions of the weights outside the layers
for its lifetime: they are held during every call anyway. ``keep=True`` keeps each layer's converted weights once
made too (one conversion, the whole converted model in memory by the end, as a copy would be): for models small
enough, where converting again at every call (every decode step) would cost more than the memory.
``fits_converted`` says which applies.

A model without ``blocks`` is converted whole on entry.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import nn

Convert = Callable[[torch.Tensor], torch.Tensor]


def _slots(module: nn.Module, skip: set[int]) -> Iterator[tuple[nn.Module, str, str]]:
    """(module, attribute, "param" | "buffer") of every floating tensor held in ``module``'s tree, modules whose id
    is in ``skip`` (and their trees) left out."""
    stack = [module]
    seen: set[int] = set()
    while stack:
        m = stack.pop()
        if id(m) in seen or id(m) in skip:
            continue
        seen.add(id(m))
        for kind, table in (("param", m._parameters), ("buffer", m._buffers)):
            for attr, t in table.items():
                if t is not None and t.is_floating_point():
                    yield m, attr, kind
        stack.extend(m._modules.values())


class _Swap:
    """Converted tensors put in place of ``slots``' tensors, undone in reverse order (a tensor held in several places,
    a tied embedding and head, is converted once and put in each); ``live``: the converted tensors in place now."""

    def __init__(self, convert: Convert) -> None:
        self.convert = convert
        self.undo: list[list[tuple[dict, str, torch.Tensor, torch.Tensor]]] = []
        self.live: set[int] = set()

    def pending(self, slots) -> list:
        """The slots whose tensor in place is not a converted one."""
        return [s for s in slots if id((s[0]._parameters if s[2] == "param" else s[0]._buffers)[s[1]]) not in self.live]

    def put(self, slots, cache: dict[int, torch.Tensor] | None) -> None:
        """Convert (or take from ``cache``, keyed by the original tensor) and put in place; one ``pop`` undoes it."""
        done: dict[int, torch.Tensor] = {}
        undo = []
        for module, attr, kind in slots:
            table = module._parameters if kind == "param" else module._buffers
            old = table[attr]
            new = done.get(id(old))
            if new is None:
                new = cache.get(id(old)) if cache is not None else None
                if new is None:
                    with torch.no_grad():
                        value = self.convert(old.detach())
                    # requires_grad as the model's: torch's linear takes another kernel path (other roundings) on it
                    new = nn.Parameter(value, requires_grad=old.requires_grad) if kind == "param" else value
                    if cache is not None:
                        cache[id(old)] = new
                done[id(old)] = new
            undo.append((table, attr, old, new))
            table[attr] = new
            self.live.add(id(new))
        self.undo.append(undo)

    def pop(self) -> None:
        for table, attr, old, new in reversed(self.undo.pop()):
            table[attr] = old
            self.live.discard(id(new))


@contextlib.contextmanager
def converted(model: nn.Module, convert: Convert = torch.Tensor.double, *, keep: bool = False,
              cache: dict[int, torch.Tensor] | None = None, outside: dict[int, torch.Tensor] | None = None) -> Iterator[nn.Module]:
    """Inside: ``model`` computes with ``convert`` applied to its floating weights and buffers, one layer's weights at
    a time (module docstring); yields ``model``. ``keep``: keep each converted tensor for the rest of the context;
    ``cache``: a dict that keeps the layers' conversions across contexts, ``outside``: one that keeps those of the
    weights outside the layers (held for a whole call anyway: an embedding converted once, not at every decode step).

    Any other module of the model that runs while its weights are not converted (one a layer calls without holding it
    as a submodule: a block shared by several layers, registered under the first) has them converted for its call."""
    blocks = list(getattr(model, "blocks", None) or [])
    if cache is None and keep:
        cache = {}
    swap = _Swap(convert)
    ours = {id(m) for m in model.modules()} - {id(model)}
    opened: list[bool] = []  # per module call in progress: whether it put conversions in place

    def enter(module, _args):
        pending = swap.pending(_slots(module, set())) if id(module) in ours else []
        if pending:
            swap.put(pending, cache)
        opened.append(bool(pending))

    def leave(_module, _args, _out):
        if opened.pop():
            swap.pop()

    swap.put(list(_slots(model, {id(b) for b in blocks})), outside if outside is not None else cache)
    handles = []
    try:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        handles.append(register_module_forward_pre_hook(enter))
        handles.append(register_module_forward_hook(leave, always_call=True))
        yield model
    finally:
        for h in handles:
            h.remove()
        while swap.undo:
            swap.pop()


class Converted:
    """``model`` as a float64 (or other ``convert``) model: calling it, or its ``step`` / ``forward``, runs ``model``
    inside ``converted`` (``keep``: conversions made once, kept while this object lives); any other attribute is
    ``model``'s."""

    def __init__(self, model: nn.Module, convert: Convert = torch.Tensor.double, *, keep: bool = False) -> None:
        self.model, self.convert = model, convert
        self.cache: dict[int, torch.Tensor] | None = {} if keep else None
        self.outside: dict[int, torch.Tensor] = {}  # the weights outside the layers: converted once, kept

    def _run(self, method: str, *args, **kwargs):
        with converted(self.model, self.convert, cache=self.cache, outside=self.outside):
            return getattr(self.model, method)(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        return self._run("__call__", *args, **kwargs)

    def forward(self, *args, **kwargs):
        return self._run("forward", *args, **kwargs)

    def step(self, *args, **kwargs):
        return self._run("step", *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.model, name)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s distinct floating parameters and buffers as they are."""
    seen: dict[int, int] = {}
    for t in (*model.parameters(), *model.buffers()):
        if t.is_floating_point():
            seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def fits_converted(model: nn.Module, factor: float = 2.0, available: int | None = None) -> bool:
    """Whether a whole converted copy (``factor`` x the weights' bytes: float64 of float32 is 2) fits in half the memory
    available now: then ``keep`` (convert once) costs less than converting at every call."""
    from edgelin.runtime.memory import available_memory

    have = available_memory() if available is None else available
    return have is not None and factor * weight_bytes(model) <= have / 2


__all__ = ["Converted", "converted", "fits_converted", "weight_bytes"]
