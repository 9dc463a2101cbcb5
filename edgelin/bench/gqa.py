"""The strongest softmax decode baseline: the softmax twin's decode step around ONNX Runtime's
``com.microsoft.GroupQueryAttention`` with a preallocated KV buffer that the op updates in place.

The twin's other decode graph (``baselines``: torch.onnx, past k/v concatenated into a new present at
every step) copies the whole cache per token; a deployment that cares about speed does not. Here the
cache of every layer is one buffer [B, H, capacity, Dh] (BNSH) bound, through IO binding, as both the
op's ``past_key`` and its ``present_key`` (likewise the values): ORT sees the same pointer and writes the
new token's k/v at its position, copying nothing. Per row, ``seqlens_k`` is the position of the new
token (its total length - 1, int32) and ``total_sequence_length`` the largest total length (int32
scalar), so rows of a batch may sit at different positions. RoPE runs inside the op (``do_rotary``,
rotate-half) from cos/sin tables that are ``edgelin.softmax.rope`` applied to the unit vector of every
rotated pair: the twin's own angles, bit for bit.

    graph       decode_graph(twin, capacity, opset) -> onnx.ModelProto; write_decode_graph(...)
    driver      KVBufferDecoder: the buffers, the IO binding, one step per call (numpy + onnxruntime)

The graph is built with ``onnx.helper`` from the twin's weights, ORT's fused ops where they exist:
embedding Gather, per layer SimplifiedLayerNormalization (RMSNorm), one packed q|k|v MatMul (the twin's
fused ``qkv`` weight is already in the op's packed layout), GroupQueryAttention, o_proj, SwiGLU (gate and
up in one MatMul), the final norm and the LM head. ORT's CPU kernel of the op takes float32 and a head
size that is a multiple of 16 (``unsupported`` says why a twin has no such graph); its CUDA kernel takes
float16/bfloat16 only, so this float32 baseline is measured on CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

from edgelin.config import ModelConfig
from edgelin.errors import EdgelinError
from edgelin.runtime.files import atomic_write
from edgelin.runtime.state import CPU, to_ortvalue
from edgelin.softmax import SoftmaxLM, rope

INPUT_IDS, LOGITS = "input_ids", "logits"  # as every edgelin graph (edgelin.exporters.graphs)
SEQLENS_K, TOTAL_LENGTH = "seqlens_k", "total_sequence_length"
MS_DOMAIN = "com.microsoft"
IR_VERSION = 10  # ONNX Runtime 1.31 reads IR <= 13; helper.make_model's default is newer


class KVBufferError(EdgelinError):
    """A KV-buffer decode step that cannot run: the buffer is full, or a cache does not fit it."""


HEAD_SIZE_MULTIPLE = 16  # ORT's GroupQueryAttention refuses other head sizes at run time


def unsupported(cfg: ModelConfig) -> str | None:
    """Why the twin of ``cfg`` has no KV-buffer graph, or None."""
    if cfg.head_dim % HEAD_SIZE_MULTIPLE:
        return f"ONNX Runtime's GroupQueryAttention needs a head size that is a multiple of {HEAD_SIZE_MULTIPLE}; the model's is {cfg.head_dim}"
    return None


def kv_keys(n_layers: int) -> list[str]:
    """The twin's KV cache keys, "{layer}.k" / "{layer}.v" (``SoftmaxLM``'s cache dict)."""
    return [f"{i}.{n}" for i in range(n_layers) for n in ("k", "v")]


def rope_tables(head_dim: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [length, head_dim / 2] of positions 0 .. length-1, read off ``edgelin.softmax.rope``: the
    unit vector (1, 0) of every rotated pair turns into (cos, sin), so the op rotates by the twin's angles."""
    unit = torch.cat([torch.ones(1, 1, length, head_dim // 2), torch.zeros(1, 1, length, head_dim // 2)], dim=-1)  # [1, 1, L, D]
    turned = rope(unit, 0)[0, 0].numpy()  # [L, D]: cos | sin
    return np.ascontiguousarray(turned[:, : head_dim // 2]), np.ascontiguousarray(turned[:, head_dim // 2 :])  # [L, D/2] each


# ---- the graph ----------------------------------------------------------------------------------
class _Builder:
    """Nodes and initializers of one graph, each output named after its node."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.weights: list[onnx.TensorProto] = []

    def weight(self, name: str, array: np.ndarray) -> str:
        self.weights.append(numpy_helper.from_array(np.ascontiguousarray(array, dtype=np.float32), name))
        return name

    def op(self, op_type: str, inputs: list[str], name: str, outputs: int | list[str] = 1, domain: str = "", **attrs: Any) -> Any:
        names = outputs if isinstance(outputs, list) else [name if outputs == 1 else f"{name}.{j}" for j in range(outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, names, name=name, domain=domain or None, **attrs))
        return names[0] if len(names) == 1 else names


def decode_graph(model: SoftmaxLM, capacity: int, opset: int) -> onnx.ModelProto:
    """The twin's decode step with KV buffers of up to ``capacity`` positions.

    input_ids int64 [B, 1], past.{i}.k/v float [B, H, capacity, Dh], seqlens_k int32 [B], total_sequence_length
    int32 [] -> logits [B, 1, V], present.{i}.k/v (the same buffers when bound to the same OrtValues)."""
    cfg = model.cfg
    why = unsupported(cfg)
    if why:
        raise KVBufferError(why)
    H, Dh, eps = cfg.n_heads, cfg.head_dim, cfg.norm_eps
    w = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    g = _Builder()
    cos, sin = rope_tables(Dh, capacity)
    g.weight("rope.cos", cos)  # [capacity, Dh/2]
    g.weight("rope.sin", sin)  # [capacity, Dh/2]

    def rms_norm(x: str, weight: str, name: str) -> str:
        return g.op("SimplifiedLayerNormalization", [x, g.weight(weight, w[weight])], name, axis=-1, epsilon=eps)

    x = g.op("Gather", [g.weight("embed.weight", w["embed.weight"]), INPUT_IDS], "embed")  # [B, 1, d_model]
    for i in range(cfg.n_layers):
        p = f"blocks.{i}"
        h = rms_norm(x, f"{p}.attn_norm.weight", f"{p}.attn_norm")  # [B, 1, d_model]
        qkv = g.op("MatMul", [h, g.weight(f"{p}.qkv.weight", w[f"{p}.attn.qkv.weight"].T)], f"{p}.qkv")  # [B, 1, 3 * H * Dh]: q | k | v
        o, _, _ = g.op("GroupQueryAttention", [qkv, "", "", f"past.{i}.k", f"past.{i}.v", SEQLENS_K, TOTAL_LENGTH, "rope.cos", "rope.sin"],
                       f"{p}.attn", [f"{p}.attn", f"present.{i}.k", f"present.{i}.v"], domain=MS_DOMAIN,
                       num_heads=H, kv_num_heads=H, do_rotary=1, rotary_interleaved=0)  # [B, 1, H * Dh]
        x = g.op("Add", [x, g.op("MatMul", [o, g.weight(f"{p}.o_proj.weight", w[f"{p}.attn.o_proj.weight"].T)], f"{p}.o_proj")], f"{p}.attn_out")
        h = rms_norm(x, f"{p}.mlp_norm.weight", f"{p}.mlp_norm")  # [B, 1, d_model]
        gate_up = np.concatenate([w[f"{p}.mlp.gate.weight"].T, w[f"{p}.mlp.up.weight"].T], axis=1)  # [d_model, 2 * hidden]
        gate, up = g.op("Split", [g.op("MatMul", [h, g.weight(f"{p}.gate_up.weight", gate_up)], f"{p}.gate_up")], f"{p}.split", 2,
                        axis=-1, num_outputs=2)  # [B, 1, hidden] each
        silu = g.op("Mul", [gate, g.op("Sigmoid", [gate], f"{p}.sigmoid")], f"{p}.silu")
        down = g.op("MatMul", [g.op("Mul", [silu, up], f"{p}.swiglu"), g.weight(f"{p}.down.weight", w[f"{p}.mlp.down.weight"].T)], f"{p}.down")
        x = g.op("Add", [x, down], f"{p}.out")  # [B, 1, d_model]
    h = rms_norm(x, "norm.weight", "norm")
    head = w["embed.weight"] if model.lm_head is None else w["lm_head.weight"]  # [V, d_model]
    g.op("MatMul", [h, g.weight("lm_head.weight", head.T)], "lm_head", [LOGITS])  # [B, 1, V]

    kv_shape = ["batch", H, "capacity", Dh]
    inputs = [helper.make_tensor_value_info(INPUT_IDS, TensorProto.INT64, ["batch", 1])]
    inputs += [helper.make_tensor_value_info(f"past.{k}", TensorProto.FLOAT, kv_shape) for k in kv_keys(cfg.n_layers)]
    inputs += [helper.make_tensor_value_info(SEQLENS_K, TensorProto.INT32, ["batch"]), helper.make_tensor_value_info(TOTAL_LENGTH, TensorProto.INT32, [])]
    outputs = [helper.make_tensor_value_info(LOGITS, TensorProto.FLOAT, ["batch", 1, cfg.vocab_size])]
    outputs += [helper.make_tensor_value_info(f"present.{k}", TensorProto.FLOAT, kv_shape) for k in kv_keys(cfg.n_layers)]
    graph = helper.make_graph(g.nodes, "softmax_gqa_decode", inputs, outputs, g.weights)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS_DOMAIN, 1)], ir_version=IR_VERSION,
                              producer_name="edgelin.bench")
    helper.set_model_props(proto, {"kv_capacity": str(capacity)})
    return proto


def write_decode_graph(model: SoftmaxLM, path: str | Path, capacity: int, opset: int) -> int:
    """Write ``decode_graph`` to ``path`` (atomically); returns its node count."""
    proto = decode_graph(model, capacity, opset)
    atomic_write(Path(path), lambda f: f.write(proto.SerializeToString()))
    return len(proto.graph.node)


def graph_capacity(session: ort.InferenceSession) -> int:
    """The longest sequence the graph's RoPE tables cover (its ``kv_capacity`` metadata)."""
    return int(session.get_modelmeta().custom_metadata_map["kv_capacity"])


# ---- the driver ---------------------------------------------------------------------------------
class KVBufferDecoder:
    """Decode steps of ``decode_graph`` on CPU, batch ``batch``, every row's cache in one buffer per layer
    and kind ([B, H, capacity, Dh], shared by past and present), every input and output bound once.

    ``lengths`` [B] counts the tokens in each row's cache; ``step(ids)`` writes each row's new k/v at its
    length, returns logits [B, 1, V] (a buffer rewritten by the next step) and adds one to every length."""

    def __init__(self, session: ort.InferenceSession, *, n_layers: int, n_heads: int, head_dim: int, batch: int, capacity: int) -> None:
        if capacity > graph_capacity(session):
            raise KVBufferError(f"a KV buffer of {capacity:,} positions is longer than the graph's RoPE tables ({graph_capacity(session):,})")
        self.session, self.batch, self.capacity = session, batch, capacity
        self.keys = kv_keys(n_layers)
        self.buffers = {k: np.zeros((batch, n_heads, capacity, head_dim), dtype=np.float32) for k in self.keys}  # [B, H, capacity, Dh] each
        self.lengths = np.zeros(batch, dtype=np.int64)  # [B]
        vocab = next(o for o in session.get_outputs() if o.name == LOGITS).shape[-1]
        self._ids = np.zeros((batch, 1), dtype=np.int64)  # [B, 1]
        self._seqlens = np.zeros(batch, dtype=np.int32)  # [B]
        self._total = np.zeros((), dtype=np.int32)  # []
        self.logits = np.zeros((batch, 1, vocab), dtype=np.float32)  # [B, 1, V]
        io = session.io_binding()
        for name, array in ((INPUT_IDS, self._ids), (SEQLENS_K, self._seqlens), (TOTAL_LENGTH, self._total)):
            io.bind_ortvalue_input(name, to_ortvalue(array, CPU))  # shares memory: written in place before each run
        io.bind_ortvalue_output(LOGITS, to_ortvalue(self.logits, CPU))
        self._values = [to_ortvalue(self.buffers[k], CPU) for k in self.keys]  # kept: the binding holds their pointers
        for key, value in zip(self.keys, self._values):
            io.bind_ortvalue_input(f"past.{key}", value)
            io.bind_ortvalue_output(f"present.{key}", value)  # the same buffer: the op appends in place
        self._io = io

    def load(self, cache: dict[str, np.ndarray], lengths: np.ndarray | list[int] | None = None) -> None:
        """Start from ``cache`` (key -> [B, H, P, Dh]); row b holds its first lengths[b] positions (default P)."""
        P = next(iter(cache.values())).shape[2]
        lengths = np.full(self.batch, P, dtype=np.int64) if lengths is None else np.asarray(lengths, dtype=np.int64)
        if P > self.capacity or lengths.shape != (self.batch,) or (lengths < 0).any() or (lengths > P).any():
            raise KVBufferError(f"a cache of {P:,} positions with lengths {lengths.tolist()} does not fit {self.batch} row(s) of {self.capacity:,}")
        for key in self.keys:
            self.buffers[key][...] = 0.0
            for b, n in enumerate(lengths):
                self.buffers[key][b, :, :n] = cache[key][b, :, :n]
        self.lengths[:] = lengths

    def cache(self) -> dict[str, np.ndarray]:
        """The cache so far, key -> [B, H, length, Dh] (views of the buffers), when every row has the same length."""
        if (self.lengths != self.lengths[0]).any():
            raise KVBufferError(f"the rows hold different lengths {self.lengths.tolist()}: read buffers[key][row, :, :length]")
        return {k: v[:, :, : int(self.lengths[0])] for k, v in self.buffers.items()}

    def step(self, ids: np.ndarray) -> np.ndarray:
        """One token per row: ids [B, 1] -> logits [B, 1, V]."""
        if int(self.lengths.max()) >= self.capacity:
            raise KVBufferError(f"the KV buffer is full ({self.capacity:,} positions); make it longer")
        self._ids[...] = ids
        self._seqlens[...] = self.lengths  # the new token's position = its total length - 1
        self._total[...] = self.lengths.max() + 1
        self.session.run_with_iobinding(self._io)
        self.lengths += 1
        return self.logits


__all__ = ["KVBufferDecoder", "KVBufferError", "decode_graph", "graph_capacity", "kv_keys", "rope_tables", "unsupported", "write_decode_graph"]
