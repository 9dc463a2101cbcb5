"""The PyTorch model computing what a quantised export computes: the reference ``edgelin validate`` holds an int8 or
int4 export's states to.

A quantised export's states differ from fp32 PyTorch's by the quantisation itself: 8-bit weights and activations
rounded to int8 per block move a trained Qwen3.5's Gated DeltaNet state by rel L2 4-7e-2 while its logits move by
1.3e-2, and 4-bit weights by 0.3-0.45. How far a quantisation may move the model is judged on its outputs (logits,
greedy and top-1 agreement, held-out text, against fp32); whether the graphs compute that quantisation, and nothing
else, is judged here: the checkpoint's model with every weight the export quantises replaced by its dequantised
values, and every activation those weights multiply rounded as ONNX Runtime rounds it. Measured on the trained
Qwen3.5 (hidden 256) in int8 blocks: the export's states within rel L2 6e-7 of this model's where no rounding step
flips, 5.7e-3 at worst where one does (validate's 4 prefill shapes), against 1.0e-2 to 6.9e-2 from fp32's.

Emulated (``arithmetic``), as exporters/precision.py writes the graphs:

    int8, scheme block  every nn.Linear weight in 8-bit blocks of 32 along K (``quantise_int8_blocks``), its input
                        rounded per block of 32 to int8 steps of max |block| / 127 (MatMulNBits, accuracy_level 4)
    int8, scheme channel  every nn.Linear weight per output channel in 7 bits (``quantise_int8_columns``), its input
                        rounded per tensor to uint8 steps with a zero point (DynamicQuantizeLinear)
    int4                every nn.Linear weight in 4-bit blocks of 32 along K, symmetric (ONNX Runtime's own
                        quantiser), its input rounded per block as for int8's block scheme; the linears a layer
                        names in ``eight_bit_linears`` (Mamba-1's out_proj) in 8-bit blocks as int8's block scheme,
                        where the export recorded them (``manifest.extra["eight_bit_weights"]``)
    routers             int8 and int4: a mixture-of-experts layer's router left in fp32, weights and input, where the
                        export recorded it (``manifest.extra["fp32_routers"]``)
    embedding           the token table as the export stores it (``manifest.extra["embedding"]``: int8, int4 or fp32,
                        blocks of 32 along d_model); a tied head reads the same dequantised table, its input rounded
                        per block where the table is quantised (MatMulNBits) and not where it stays fp32; an int4
                        export's untied head is stored the same way

An export that does not record its embedding storage (made before it was recorded), or a model whose head is neither
an nn.Linear nor tied to an nn.Embedding, gets no reference (None): validate then holds its states to fp32 PyTorch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

from edgelin import streaming
from edgelin.layers.moe import moe_layers
from edgelin.runtime.manifest import Manifest

BLOCK = 32  # MatMulNBits' block and the activations' rounding block (exporters/precision.py: INT8_BLOCK, INT4_BLOCK)


def arithmetic(manifest: Manifest) -> str | None:
    """What the quantised reference of ``manifest``'s export computes, in words; None where there is none."""
    embedding = manifest.extra.get("embedding")
    if manifest.precision not in ("int8", "int4") or embedding not in ("int8", "int4", "fp32"):
        return None
    scheme = manifest.extra.get("int8_scheme", "channel") if manifest.precision == "int8" else None
    if scheme not in (None, "channel", "block"):
        return None
    weights = {"block": "8-bit weights in blocks of 32, activations rounded to int8 per block",
               "channel": "7-bit weights per output channel, activations rounded to uint8 per tensor",
               None: "4-bit weights in blocks of 32, activations rounded to int8 per block"}[scheme]
    eight = _eight_bit_count(manifest)
    if eight:
        weights += f" ({eight} with outlier inputs in 8-bit blocks)"
    if manifest.extra.get("fp32_routers"):
        weights += "; mixture-of-experts routers in fp32"
    return f"{weights}; the embedding table in {embedding}"


def _eight_bit_count(manifest: Manifest) -> int:
    """How many weights an int4 export stored in 8-bit blocks because their layer asked (``eight_bit_linears``)."""
    return int(manifest.extra.get("eight_bit_weights") or 0) if manifest.precision == "int4" else 0


def eight_bit_linears(model: nn.Module) -> list[nn.Linear]:
    """The linears an int4 export keeps in 8-bit blocks: those each layer names in its ``eight_bit_linears`` (a layer
    whose projection reads inputs with outlier channels, where 4-bit weight rows cost most of the held-out loss)."""
    found = []
    for module in model.modules():
        for name in getattr(module, "eight_bit_linears", ()):
            linear = getattr(module, name, None)
            if isinstance(linear, nn.Linear):
                found.append(linear)
    return found


def round_blocks(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """``x`` with each block of ``block`` values along the last axis rounded to int8 steps of max |block| / 127 (a
    last block shorter than ``block`` as if zero-padded): what MatMulNBits at accuracy_level 4 multiplies."""
    K = x.shape[-1]
    pad = (-K) % block
    b = nn.functional.pad(x, (0, pad)).reshape(*x.shape[:-1], -1, block)
    step = b.abs().amax(-1, keepdim=True) / 127
    step = torch.where(step == 0, torch.ones_like(step), step)
    return (torch.round(b / step) * step).reshape(*x.shape[:-1], K + pad)[..., :K]


def round_tensor(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded as DynamicQuantizeLinear rounds it: one uint8 scale and zero point for the whole tensor, over a
    range that includes 0."""
    lo, hi = torch.clamp(x.min(), max=0.0), torch.clamp(x.max(), min=0.0)
    scale = (hi - lo) / 255
    if float(scale) == 0.0:
        return torch.zeros_like(x)
    zero = torch.clamp(torch.round(-lo / scale), 0, 255)
    return (torch.clamp(torch.round(x / scale) + zero, 0, 255) - zero) * scale


def _int8_blocks(w: np.ndarray) -> np.ndarray:
    from edgelin.exporters.precision import INT8_BLOCK, dequantise_table, quantise_int8_blocks

    K, N = w.shape
    packed, scales = quantise_int8_blocks(w)
    return dequantise_table(packed.reshape(N, -1), scales.reshape(N, -1), 8, INT8_BLOCK)[:, :K].T


def _int8_columns(w: np.ndarray) -> np.ndarray:
    from edgelin.exporters.precision import quantise_int8_columns

    q, scale = quantise_int8_columns(w)
    return q.astype(np.float32) * scale


def _int4_blocks(w: np.ndarray) -> np.ndarray:
    """ONNX Runtime's symmetric 4-bit block quantiser (the one ``MatMulNBitsQuantizer`` calls), dequantised."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits

    K, N = w.shape
    blocks = -(-K // BLOCK)
    padded = np.zeros((blocks * BLOCK, N), np.float32)
    padded[:K] = w
    packed = np.zeros((N, blocks, BLOCK // 2), np.uint8)
    scales = np.zeros((N, blocks), np.float32)
    zero = np.zeros((N, (blocks + 1) // 2), np.uint8)
    quantize_matmul_4bits(packed, padded, scales, zero, BLOCK, N, blocks * BLOCK, True)
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(N, blocks, BLOCK).astype(np.float32)
    return ((codes - 8) * scales[..., None]).reshape(N, -1)[:, :K].T


def _table(weight: torch.Tensor, storage: str) -> torch.Tensor:
    from edgelin.exporters.precision import EMBEDDING_BITS, TABLE_BLOCK, dequantise_table, quantise_table

    table = weight.detach().float().numpy()
    if storage == "fp32" or table.shape[1] % TABLE_BLOCK:  # the export keeps such a table in fp32 too
        return weight.detach().clone()
    bits = EMBEDDING_BITS[storage]
    return torch.from_numpy(dequantise_table(*quantise_table(table, bits), bits))


def quantised_model(model: nn.Module, manifest: Manifest, scratch: Path | None = None) -> nn.Module | None:
    """A model computing what the quantised export of ``manifest`` computes (see the module docstring), built beside
    ``model`` without copying its weights: each weight of the reference is made from ``model``'s one tensor at a time,
    into memory, or with ``scratch`` (a folder) into a scratch file there that is mapped back (``edgelin.streaming``:
    the reference's weights are then file pages, as a streamed model's are). None where ``arithmetic`` has none or the
    model's head cannot be told apart."""
    if arithmetic(manifest) is None:
        return None
    scheme = manifest.extra.get("int8_scheme", "channel") if manifest.precision == "int8" else "int4"
    weights: Callable[[np.ndarray], np.ndarray] = {"block": _int8_blocks, "channel": _int8_columns, "int4": _int4_blocks}[scheme]
    rounding = round_tensor if scheme == "channel" else round_blocks
    storage = manifest.extra["embedding"]
    head = getattr(model, "lm_head", "absent")
    embed = getattr(model, "embed", None)
    if head is None and not isinstance(embed, nn.Embedding):
        return None  # a tied head whose table is not an nn.Embedding: nothing here says how the export stores it
    q = streaming.weightless_copy(model).float().eval()

    def round_input(_module, args):
        return (rounding(args[0]),) + tuple(args[1:])

    made: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}  # parameter name -> its value from the model's
    names = {id(m): name for name, m in q.named_modules()}
    own_head = q.lm_head if manifest.precision == "int4" and isinstance(head, nn.Linear) else None
    if own_head is not None:  # int4 stores an untied head as the table is (exporters/precision.py: _quantise_untied_head)
        made[f"{names[id(own_head)]}.weight"] = lambda w: _table(w, storage)
        if storage != "fp32" and own_head.weight.shape[1] % BLOCK == 0:
            own_head.register_forward_pre_hook(lambda _m, a: (round_blocks(a[0]),) + tuple(a[1:]))
    eight = {id(m) for m in eight_bit_linears(q)} if _eight_bit_count(manifest) else set()
    # mixture-of-experts routers the export left in fp32 (its manifest's fp32_routers: exports since that rule)
    routers = {id(m.router) for m in moe_layers(q)} if manifest.extra.get("fp32_routers") else set()
    for moe in moe_layers(q):  # each expert on the rows routed to it, as the graph gathers them: its inputs rounded there
        moe.call_modules = True
    for module in q.modules():
        if isinstance(module, nn.Linear) and module is not own_head and id(module) not in routers:
            stored = _int8_blocks if id(module) in eight else weights  # int4's 8-bit linears: MatMulNBits, 8 bits, block 32
            made[f"{names[id(module)]}.weight"] = lambda w, stored=stored: torch.from_numpy(
                np.ascontiguousarray(stored(w.float().numpy().T).T))
            module.register_forward_pre_hook(round_input)
    if isinstance(embed, nn.Embedding):
        made[f"{names[id(q.embed)]}.weight"] = lambda w: _table(w, storage)
    values = ((name, made[name](p.detach()) if name in made else p) for name, p in model.named_parameters())  # the rest shared
    streaming.place_parameters(q, values, scratch)
    if isinstance(embed, nn.Embedding) and head is None:
        # tied: the head reads the same table; a MatMulNBits (input rounded) where it is quantised
        table = q.embed.weight
        q.lm_head = nn.Linear(table.shape[1], table.shape[0], bias=False, device="meta")
        q.lm_head.weight = table
        if storage != "fp32" and table.shape[1] % BLOCK == 0:
            q.lm_head.register_forward_pre_hook(lambda _m, a: (round_blocks(a[0]),) + tuple(a[1:]))
    return q


__all__ = ["BLOCK", "arithmetic", "eight_bit_linears", "quantised_model", "round_blocks", "round_tensor"]
