"""Routing agreement of a mixture-of-experts export: of every (token, MoE layer), the share whose chosen experts in
the prefill graph are the PyTorch model's. Each MoE layer routes with one TopK node (edgelin.ops.moe.route); a
copy of a graph returns those nodes' indices as outputs, in layer order, and is run on the same inputs as the
model, whose routers are read by hooks. The share is held to the precision's top-1 budget (a near tie between two
experts may flip, as a near tie between two tokens does).

Where a token's experts differ, its logits differ by what another expert computes, not by rounding: the prefill and
decode checks set those positions aside (``prefill_differs``, ``decode_differs``), say how many, and hold the logits
of the others; the routing check counts them."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from edgelin.layers.moe import moe_layers
from edgelin.runtime.manifest import positions_feed
from edgelin.runtime.providers import make_session_options
from edgelin.runtime.session import Session
from edgelin.validate.report import FAIL, NA, PASS, Check
from edgelin.validate.validator import Validator

BATCH, LENGTH = 2, 200


@contextlib.contextmanager
def routing_capture(model: torch.nn.Module) -> Iterator[list[np.ndarray]]:
    """While inside: each MoE layer's chosen experts, [B T, k], appended as the model runs (module order = layer order),
    read by hooks on the layers' inputs."""
    chosen: list[np.ndarray] = []
    def read(module, args) -> None:
        chosen.append(module.routing(args[0])[0].numpy())

    hooks = [m.register_forward_pre_hook(read) for m in moe_layers(model)]
    try:
        yield chosen
    finally:
        for h in hooks:
            h.remove()


def reference_routing(model: torch.nn.Module, ids: np.ndarray, run: Callable[[torch.Tensor], object] | None = None) -> list[np.ndarray]:
    """The model's chosen experts per MoE layer, [B T, k] each (module order = layer order), while ``run`` (default:
    the model's prefill from a fresh state) runs on ``ids`` [B, T]."""
    with routing_capture(model) as chosen, torch.no_grad():
        (run or model)(torch.from_numpy(ids))
    return chosen


def topk_session(graph_file: Path, folder: Path):
    """(an ONNX Runtime session of a copy of the graph in ``graph_file`` whose outputs are its TopK nodes' indices, in
    graph order, those outputs' names); (None, []) where the graph has no TopK node. ``folder``: where its weights are."""
    import onnx
    import onnxruntime as ort

    proto = onnx.load(str(graph_file), load_external_data=False)
    tops = [n.output[1] for n in proto.graph.node if n.op_type == "TopK"]
    if not tops:
        return None, []
    del proto.graph.output[:]
    proto.graph.output.extend(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.INT64, None) for name in tops)
    options = make_session_options(1)
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"]), tops


def _routing_session(v: Validator, graph: str):
    """``topk_session`` of the export's ``graph``, made once per validation."""
    cache = v.__dict__.setdefault("_routing_sessions", {})
    if graph not in cache:
        cache[graph] = topk_session(v.manifest.graph_path(v.export_dir, graph), v.export_dir)
    return cache[graph]


def graph_routing(v: Validator, session: Session, ids: np.ndarray) -> list[np.ndarray] | None:
    """The prefill graph's chosen experts per TopK node, in graph order, on ``ids`` from a fresh state; None where
    the graph has no TopK node."""
    m = v.manifest
    sess, tops = _routing_session(v, "prefill")
    if sess is None:
        return None
    B, T = ids.shape
    state = session.new_state(B)
    feeds = {m.input_ids: ids, **{s.input: value.numpy() for s, value in zip(m.states, state.values)}}
    if m.lengths is not None:
        feeds[m.lengths] = np.full(B, T, dtype=np.int64)
    if m.logits_at is not None:
        feeds[m.logits_at] = positions_feed(B, T)
    return sess.run(tops, feeds)


def agreeing(got: list[np.ndarray] | None, want: list[np.ndarray]) -> list[np.ndarray] | None:
    """Per MoE layer, [B T] bool: the token's chosen experts (as a set) are the same in the graph and the model; None
    where the graph's TopK nodes do not pair with the model's MoE layers."""
    if got is None or len(got) != len(want):
        return None
    return [np.all(np.sort(g.reshape(w.shape), -1) == np.sort(w, -1), axis=-1) for g, w in zip(got, want)]


def differs(got: list[np.ndarray] | None, want: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray | None:
    """Bool of ``shape`` ([B, T] or [B, 1]): the tokens whose chosen experts differ between ``got`` and ``want`` in any
    MoE layer (``agreeing``); None where they do not pair."""
    same = agreeing(got, want)
    return None if same is None else ~np.logical_and.reduce(same).reshape(shape)


def prefill_differs(v: Validator, session: Session, ids: np.ndarray) -> np.ndarray | None:
    """[B, T] bool: the positions of ``ids`` (a prefill from a fresh state) where any MoE layer's chosen experts in
    the prefill graph differ from the model's; None for a model without an MoE layer or a graph whose TopK nodes
    do not pair with its MoE layers (the routing check says so)."""
    if not moe_layers(v.model):
        return None
    return differs(graph_routing(v, session, ids), reference_routing(v.model, ids), ids.shape)


def step_routing(v: Validator, x: np.ndarray, state: dict) -> tuple[torch.Tensor, dict, list[np.ndarray] | None]:
    """The model's decode step on ``x`` [B, 1] from ``state``: (logits, next state, its chosen experts per MoE layer,
    None for a model without an MoE layer), read by hooks during that one step."""
    if not moe_layers(v.model):
        with torch.no_grad():
            return (*v.model.step(torch.from_numpy(x), state), None)
    with routing_capture(v.model) as chosen, torch.no_grad():
        logits, state = v.model.step(torch.from_numpy(x), state)
    return logits, state, chosen


def decode_differs(v: Validator, x: np.ndarray, state_before: dict[str, np.ndarray], want: list[np.ndarray] | None) -> np.ndarray | None:
    """[B] bool: the rows of one decode step (ids ``x`` [B, 1] from the graph's state ``state_before``, the state
    inputs by name) whose chosen experts in the decode graph differ from ``want`` (``step_routing``'s) in any MoE
    layer; None as ``prefill_differs``."""
    if want is None:
        return None
    sess, tops = _routing_session(v, "decode")
    if sess is None:
        return None
    got = sess.run(tops, {v.manifest.input_ids: x, **state_before})
    return differs(got, want, x.shape)


def routing_agreement(v: Validator, session: Session) -> None:
    """The "routing" check of an MoE model (nothing for a model without one)."""
    layers = moe_layers(v.model)
    if not layers:
        return
    ids = v.ids(BATCH, LENGTH)
    want = reference_routing(v.model, ids)
    got = graph_routing(v, session, ids)
    name = f"routing agreement ({BATCH * LENGTH} tokens x {len(layers)} MoE layers)"
    same = agreeing(got, want)
    if same is None:
        found = 0 if got is None else len(got)
        v.add(Check("routing", name, NA, where=f"the prefill graph has {found} TopK nodes for {len(layers)} MoE layers"))
        return
    share = float(np.mean(same))
    need = v.budgets["top1"]["min_agreement"]
    worst = int(np.argmin([s.mean() for s in same]))
    where = "" if share >= need else f"agreement {share:.4f} < {need}; MoE layer {worst} agrees least ({same[worst].mean():.4f})"
    v.add(Check("routing", f"routing agreement {share * 100:.2f}% ({BATCH * LENGTH} tokens x {len(layers)} MoE layers)",
                FAIL if where else PASS, budget={"min_agreement": need}, where=where))


__all__ = ["agreeing", "decode_differs", "differs", "graph_routing", "prefill_differs", "reference_routing", "routing_agreement",
           "routing_capture", "step_routing", "topk_session"]
