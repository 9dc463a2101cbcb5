"""Routing agreement of a mixture-of-experts export: of every (token, MoE layer), the share whose chosen experts in
the prefill graph are the PyTorch model's. Each MoE layer routes with one TopK node (edgelin.ops.moe.route); a
copy of the prefill graph returns those nodes' indices as outputs, in layer order, and is run on the same ids as
the model, whose routers are read by hooks. The share is held to the precision's top-1 budget (a near tie
between two experts may flip, as a near tie between two tokens does)."""

from __future__ import annotations

import numpy as np
import torch

from edgelin.layers.moe import moe_layers
from edgelin.runtime.manifest import positions_feed
from edgelin.runtime.providers import make_session_options
from edgelin.runtime.session import Session
from edgelin.validate.report import FAIL, NA, PASS, Check
from edgelin.validate.validator import Validator

BATCH, LENGTH = 2, 200


def reference_routing(model: torch.nn.Module, ids: np.ndarray) -> list[np.ndarray]:
    """The model's chosen experts per MoE layer, [B T, k] each (module order = layer order), on ``ids`` [B, T]."""
    chosen: list[np.ndarray] = []
    def read(module, args) -> None:
        chosen.append(module.routing(args[0])[0].numpy())

    hooks = [m.register_forward_pre_hook(read) for m in moe_layers(model)]
    try:
        with torch.no_grad():
            model(torch.from_numpy(ids))
    finally:
        for h in hooks:
            h.remove()
    return chosen


def graph_routing(v: Validator, session: Session, ids: np.ndarray) -> list[np.ndarray] | None:
    """The prefill graph's chosen experts per TopK node, in graph order, on ``ids`` from a fresh state; None where
    the graph has no TopK node."""
    import onnx
    import onnxruntime as ort

    m = v.manifest
    proto = onnx.load(str(m.graph_path(v.export_dir, "prefill")), load_external_data=False)
    tops = [n.output[1] for n in proto.graph.node if n.op_type == "TopK"]
    if not tops:
        return None
    del proto.graph.output[:]
    proto.graph.output.extend(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.INT64, None) for name in tops)
    options = make_session_options(1)
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(v.export_dir))
    sess = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    B, T = ids.shape
    state = session.new_state(B)
    feeds = {m.input_ids: ids, **{s.input: value.numpy() for s, value in zip(m.states, state.values)}}
    if m.lengths is not None:
        feeds[m.lengths] = np.full(B, T, dtype=np.int64)
    if m.logits_at is not None:
        feeds[m.logits_at] = positions_feed(B, T)
    return sess.run(tops, feeds)


def routing_agreement(v: Validator, session: Session) -> None:
    """The "routing" check of an MoE model (nothing for a model without one)."""
    layers = moe_layers(v.model)
    if not layers:
        return
    ids = v.ids(BATCH, LENGTH)
    want = reference_routing(v.model, ids)
    got = graph_routing(v, session, ids)
    name = f"routing agreement ({BATCH * LENGTH} tokens x {len(layers)} MoE layers)"
    if got is None or len(got) != len(want):
        found = 0 if got is None else len(got)
        v.add(Check("routing", name, NA, where=f"the prefill graph has {found} TopK nodes for {len(layers)} MoE layers"))
        return
    same = [np.all(np.sort(g.reshape(w.shape), -1) == np.sort(w, -1), axis=-1) for g, w in zip(got, want)]  # [B T] per layer
    share = float(np.mean(same))
    need = v.budgets["top1"]["min_agreement"]
    worst = int(np.argmin([s.mean() for s in same]))
    where = "" if share >= need else f"agreement {share:.4f} < {need}; MoE layer {worst} agrees least ({same[worst].mean():.4f})"
    v.add(Check("routing", f"routing agreement {share * 100:.2f}% ({BATCH * LENGTH} tokens x {len(layers)} MoE layers)",
                FAIL if where else PASS, budget={"min_agreement": need}, where=where))


__all__ = ["graph_routing", "reference_routing", "routing_agreement"]
