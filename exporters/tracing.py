"""The trace: a torch module -> an ONNX file through torch.onnx with edgelin's settings (dynamo, optimised, quiet),
both graphs of a model traced or taken from the trace cache, what edgelin changes in torch.onnx's own steps
(the rewriter's prefilter, the fake-tensor cache off, the rewriter's hold on the last graph released), and a
failure said in one line."""

from __future__ import annotations

import contextlib
import io
import logging
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

from edgelin.exporters import deferred, traces
from edgelin.exporters.graphs import graph_spec
from edgelin.exporters.write import GRAPH_FILES
from edgelin.layers.moe import moe_layers
from edgelin.ops import fused, moe
from edgelin.ops.delta import sequence_bound


@contextlib.contextmanager
def _quiet():
    """torch.onnx prints its progress and warnings; keep the user's terminal for ours."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    sink = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink):
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def export_graph(
    module: torch.nn.Module, example: tuple, names: tuple[list[str], list[str]], dynamic, opset: int, path: Path, *, external: bool = False,
    ops: str = fused.DEFAULT_LOWERING,
) -> None:
    """One torch module -> one ONNX file with edgelin's exporter settings (dynamo, optimised, quiet).

    names: (input names, output names); dynamic: torch.export dynamic_shapes for ``example``. ``external``: the
    weights go to ``<file>.data`` beside it (always so for a graph over protobuf's 2 GB). ``ops``: the lowering
    (``edgelin.ops.fused``): "portable" (ONNX standard operators) or "fused" (ONNX Runtime's LinearAttention node).
    """
    inputs, outputs = names
    table = fused.translation_table() if ops == "fused" else None
    if moe_layers(module):
        table = {**(table or {}), **moe.translation_table()}  # each expert's rows only (edgelin.ops.moe)
    with _quiet(), torch.no_grad(), fused.lowering(ops), _tracer_settings(), _rewriter_prefilter():
        program = torch.onnx.export(
            module.eval(), example, input_names=inputs, output_names=outputs,
            dynamic_shapes=dynamic, dynamo=True, opset_version=opset, optimize=True, verbose=False,
            custom_translation_table=table,
        )
        try:
            if external and deferred.active() is not None:
                deferred.save(program.model, path)  # the model's weights left unwritten (edgelin.exporters.deferred)
            else:
                program.save(str(path), external_data=external or None)
        finally:
            del program
            release_rewriter_state()


@contextlib.contextmanager
def _tracer_settings():
    """torch's fake-tensor dispatch cache off while tracing: it is kept for compiled code that runs many times,
    and an export traces each op once, where its lookups cost more than they save (a delta-rule model's export:
    ~15 % faster without it; the graph is the same, only the names torch gives size values differ)."""
    config = getattr(getattr(torch, "_dynamo", None), "config", None)
    if config is None or not hasattr(config, "fake_tensor_cache_enabled"):
        yield
        return
    with config.patch(fake_tensor_cache_enabled=False):
        yield


@contextlib.contextmanager
def _rewriter_prefilter():
    """Make onnxscript's rewriter linear in the graph's size again, with the same result.

    torch.onnx.export's optimiser tries every rewrite rule at every node. For a rule whose pattern has several
    output nodes (onnxscript 0.7's ``SlicesSplit``: two Slices -> one Split) the matcher first indexes the whole
    graph by op type, at every node, before it checks that node at all: quadratic in the graph's size (a delta-rule
    model's export spent 2.0 / 6.8 / 36.5 s in it at 2 / 4 / 8 layers, 41 % of the export at 8). Here a node that
    the pattern's first output node does not match is refused before the index is built -- the very check the
    matcher makes first on every combination it then tries, so every rule matches exactly where it did before.
    Where onnxscript's matcher is not the one this was written against, nothing is changed."""
    try:
        from onnxscript.rewriter import _basics, _matcher, _pattern_ir

        cls, result = _matcher.SimplePatternMatcher, _basics.MatchResult
        original = cls.match
        _pattern_ir.NodePattern.matches, result.fail  # what the check below calls
    except (ImportError, AttributeError):
        original = None
    if original is None:
        yield
        return

    def match(self, model, graph_or_function, node, *args, **kwargs):
        outputs = getattr(getattr(self, "pattern", None), "output_nodes", None)  # the pattern's output nodes
        if isinstance(outputs, list) and len(outputs) > 1 and isinstance(outputs[0], _pattern_ir.NodePattern):
            if not outputs[0].matches(node, result()):
                return result().fail(f"{node.op_type} is not the pattern's first output node")
        return original(self, model, graph_or_function, node, *args, **kwargs)

    cls.match = match
    try:
        yield
    finally:
        cls.match = original


def _rewrite_rules() -> list:
    """onnxscript's rewrite rules that live in its modules' globals (alone, in lists or tuples, or in rule sets)."""
    found, seen = [], set()

    def visit(value, depth: int = 0) -> None:
        if id(value) in seen or depth > 2:
            return
        seen.add(id(value))
        if hasattr(value, "_matcher"):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item, depth + 1)
        elif type(value).__name__ == "RewriteRuleSet":
            visit(getattr(value, "rules", ()), depth + 1)

    for name, module in list(sys.modules.items()):
        if name.startswith("onnxscript.") and module is not None:
            for value in list(vars(module).values()):
                visit(value)
    return found


def release_rewriter_state() -> int:
    """Let go of the graph torch.onnx.export optimised.

    onnxscript's rewrite rules are module-level objects whose matchers keep the last graph, node and match they
    looked at; that graph's initializers wrap the model's own parameters, so an exported model's weights stayed in
    memory for as long as the process lived (a 1.2 B model: 4.7 GB after ``export`` returned). The matchers set
    these fields again at the start of every match, so clearing them changes nothing but what is held. Returns the
    number of matchers cleared (0 where onnxscript keeps no such state)."""
    cleared = 0
    for rule in _rewrite_rules():
        matcher = getattr(rule, "_matcher", None)
        held = [a for a in ("_graph", "_current_node", "_tracer", "_match") if getattr(matcher, a, None) is not None]
        for attr in held:
            setattr(matcher, attr, None)
        cleared += bool(held)
    return cleared


def trace_graph(spec, names, opset: int, path: Path, ops: str, max_sequence: int) -> bool:
    """Trace one graph into ``path``; True where its graph depends on ``max_sequence``."""
    with sequence_bound(max_sequence) as bound:
        export_graph(spec.module, spec.example, names, spec.dynamic_shapes, opset, path, external=True, ops=ops)
    return bound.used


def trace_graphs(model, tmp: Path, *, ragged: bool, logits_at: bool, opset: int, ops: str, max_sequence: int,
                 trace_cache: str | Path | None, say: Callable[[str], None],
                 after: Callable[[str], None] | None = None) -> tuple[dict[str, float], bool]:
    """Both graphs of ``model`` traced into ``tmp`` (``GRAPH_FILES``), or taken from the trace cache where it holds
    them (``edgelin.exporters.traces``); ``after(graph)`` runs once each graph is there, before the next is traced (the
    exporter converts it then: its float32 weights leave the disk before the next graph writes its own). Returns
    (seconds per graph, whether a graph depends on ``max_sequence``)."""
    seconds, bounded = {}, False
    cache = None if trace_cache is None else traces.TraceCache(trace_cache)
    if cache is not None:
        say(f"trace cache {cache.root}: hashing the model's weights and code ...")
        model_part = traces.model_key(model)
    for graph, fname in GRAPH_FILES.items():
        t0 = time.perf_counter()
        spec = graph_spec(model, graph, lengths=ragged, logits_at=logits_at)
        names = (spec.input_names, spec.output_names)
        if cache is None:
            say(f"exporting the {graph} graph (opset {opset}) ...")
            bounded |= trace_graph(spec, names, opset, tmp / fname, ops, max_sequence)
        else:
            key = traces.trace_key(model_part, graph=graph, names=names, example=spec.example, dynamic=spec.dynamic_shapes,
                                   opset=opset, ops=ops, max_sequence=max_sequence)
            with cache.lock(key):
                hit = cache.lookup(key, tmp)
                if hit is not None:
                    say(f"the {graph} graph: traced before, taken from the trace cache ({key[:12]})")
                    bounded |= hit.bound_used
                else:
                    say(f"exporting the {graph} graph (opset {opset}) ...")
                    before = {p.name for p in tmp.iterdir()}
                    used = trace_graph(spec, names, opset, tmp / fname, ops, max_sequence)
                    bounded |= used
                    try:
                        cache.store(key, tmp, sorted(p.name for p in tmp.iterdir() if p.name not in before), used)
                    except OSError as exc:
                        say(f"the {graph} graph's trace was not kept in {cache.root}: {exc}")
        seconds[graph] = time.perf_counter() - t0
        if after is not None:
            after(graph)
        del spec  # it holds the model: nothing but ``model`` should, once the reference outputs are made
    return seconds, bounded


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def failure_cause(exc: BaseException) -> str:
    """"Type: first line" of what went wrong, for one line: the innermost exception of the chain (torch.onnx wraps
    torch.export's reason in an error of its own whose first line is only "Failed to export the model with
    torch.export. This is step 1/3 ..."), terminal colour codes removed, at most 300 characters."""
    seen, root = {id(exc)}, exc
    while (nxt := root.__cause__ or root.__context__) is not None and id(nxt) not in seen:
        seen.add(id(nxt))
        root = nxt
    text = _ANSI.sub("", str(root)).strip()
    first = (text.splitlines() or [""])[0].strip()
    what = type(root).__name__ + (f": {first}" if first else "")
    if root is not exc:  # the step that failed, then why
        what = f"{type(exc).__name__} <- {what}"
    return what[:300]
