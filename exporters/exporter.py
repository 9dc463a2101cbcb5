"""A model -> ``prefill.onnx`` + ``decode.onnx`` + ``edgelin.json``, written atomically.

The model is anything that follows the model protocol (``edgelin.protocol``): edgelin's ``LinearLM``, a
model imported from a foreign checkpoint, or the user's own module.

Everything is written into a temporary folder beside the destination and moved into place only after
both graphs exported, passed ``onnx.checker`` (full check) and, unless ``check=False``, a smoke
comparison of ONNX Runtime (CPU) against PyTorch. A failure leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import logging
import os
import re
import shutil
import time
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnx
import torch

from edgelin import __version__, parity, protocol, upstream
from edgelin.checkpoint import Checkpoint, load_checkpoint, model_sha256, open_checkpoint
from edgelin.errors import EdgelinError, ExportError
from edgelin.exporters.graphs import INPUT_IDS, LENGTHS, LOGITS, LOGITS_AT, graph_spec
from edgelin.exporters import traces
from edgelin.ops import fused
from edgelin.exporters.precision import check_precision, state_dtypes
from edgelin.exporters.precision import convert as convert_precision
from edgelin.exporters.precision import embedding_choice, int8_file, int8_scheme_choice
from edgelin.exporters.tokenizer import find_tokenizer, hf_tokenizer_entry
from edgelin.exporters.weights import load_graph, save_graph, store_once, tied_head_in_place
from edgelin.ops.delta import DEFAULT_MAX_SEQUENCE, sequence_bound
from edgelin.runtime import golden
from edgelin.runtime.files import check_output_dir, check_path, remove_created, remove_stale_temps, replace_dir, uninterrupted, work_dir, work_files, write_failure
from edgelin.runtime.manifest import MANIFEST_FILE, METADATA_KEY, PREFILL_PIECE, Manifest, file_sha256
from edgelin.safety import check_finite_weights
from edgelin.state import fresh_state, from_numpy, to_numpy

MIN_OPSET, MAX_OPSET = 18, 23  # the default exporter's lowest opset .. the newest ORT 1.2x runs
DEFAULT_OPSET = 18  # the most portable: older edge runtimes read it
MAX_CHUNK = 4096
MAX_SEQUENCE_LIMIT = 1 << 31  # the manifest's bound on max_sequence
GRAPH_FILES = {"prefill": "prefill.onnx", "decode": "decode.onnx"}
SMOKE_STEPS = 4  # greedy decode steps of the smoke check

Progress = Callable[[str], None]


@dataclass
class ExportResult:
    out_dir: Path
    manifest: Manifest
    files: dict[str, int]  # file name -> bytes
    nodes: dict[str, int]  # graph -> node count
    seconds: dict[str, float]  # graph -> export wall time
    smoke: dict[str, parity.Errors] | None = None  # check name -> logits errors (None with check=False)
    # check name -> the budget it was held to (edgelin's or the export's, raised to the model's rounding floor or, at
    # fp16, to the checkpoint's framework's own error at fp16: edgelin.upstream.precision_floor)
    smoke_bounds: dict[str, dict[str, float]] = field(default_factory=dict)
    op_types: dict[str, dict[str, int]] = field(default_factory=dict)  # graph -> op type -> count

    def summary(self) -> str:
        lines = [f"exported to {self.out_dir}"]
        for name, size in self.files.items():
            graph = next((g for g, f in GRAPH_FILES.items() if f == name), None)
            detail = f"  {self.nodes[graph]:4d} nodes  exported in {self.seconds[graph]:.1f} s" if graph else ""
            lines.append(f"  {name:14s} {size / 1e6:8.2f} MB{detail}")
        m = self.manifest
        lines.append(f"  state per sequence: {m.state_summary()}")
        if self.manifest.lengths is not None:
            lines.append(f"  ragged prefill: input {self.manifest.lengths!r} takes each row's length (prompts of different lengths in one call)")
        if m.logits_at is not None:
            lines.append(f"  prefill logits: at the positions input {m.logits_at!r} asks for (the runtimes: each piece's last only)")
        else:
            lines.append("  prefill logits: every position (no logits_at input: for a client older than it)")
        if m.max_sequence is not None:
            lines.append(f"  prefill calls: at most {m.max_sequence:,} tokens each (max_sequence; the runtimes cut longer prompts into pieces)")
        if self.smoke is None:
            lines.append("  smoke check: skipped (--no-check)")
        else:
            table = parity.held(self.manifest.precision, self.manifest.extra.get("parity_budgets"))[0]["logits"]
            bounds = {k: self.smoke_bounds.get(k, table) for k in self.smoke}
            ok = all(parity.within(e, bounds[k]) for k, e in self.smoke.items())
            peer = upstream.PrecisionFloor.from_record(self.manifest.extra.get("precision_floor"))
            why = "the model's rounding floor" if peer is None else f"{upstream.possessive(peer.framework)} own {peer.dtype} error"
            parts = ", ".join(f"{k} {e.max_rel:.1e}" + (f" (budget {bounds[k]['max_rel']:.1e}: {why})"
                                                        if bounds[k]["max_rel"] > table["max_rel"] else "")
                              for k, e in self.smoke.items())
            lines.append(f"  smoke check (ORT CPU vs PyTorch, logits max abs / max |logit|; budget {table['max_rel']:.0e}): {parts} -> {'ok' if ok else 'FAIL'}")
        return "\n".join(lines)


def _check_options(opset: int, chunk_size: int | None, max_sequence: int = DEFAULT_MAX_SEQUENCE) -> None:
    if not isinstance(opset, int) or not MIN_OPSET <= opset <= MAX_OPSET:
        raise ExportError(f"opset {opset!r} is not supported; choose {MIN_OPSET}..{MAX_OPSET} (default {DEFAULT_OPSET})")
    if isinstance(max_sequence, bool) or not isinstance(max_sequence, int) or not 1 <= max_sequence <= MAX_SEQUENCE_LIMIT:
        raise ExportError(f"max sequence {max_sequence!r} is out of range; choose 1..{MAX_SEQUENCE_LIMIT} tokens per prefill call "
                          f"(default {DEFAULT_MAX_SEQUENCE})")
    if chunk_size is not None and (not isinstance(chunk_size, int) or not 1 <= chunk_size <= MAX_CHUNK):
        raise ExportError(f"chunk size {chunk_size!r} is out of range; choose 1..{MAX_CHUNK} (64 is a good default)")


def _resolve_source(source, chunk_size: int | None) -> tuple[torch.nn.Module, str]:
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


def build_manifest(
    model, *, opset: int, source: str, precision: str = "fp32", extra: dict | None = None, logits_dtype: str | None = None,
    ragged: bool = False, tokenizer: dict | None = None, logits_at: bool = True,
) -> Manifest:
    """The manifest of ``model``'s export (edgelin/2): states straight from its state contract, the io of
    both graphs, the runtime's prefill piece, the prefill graph's ``lengths`` input when ``ragged`` and its
    ``logits_at`` input unless told not to (the runtimes ask for a prompt's last position only), the
    ``tokenizer`` entry given (a checkpoint's Hugging Face tokenizer) or the model's own. The graph
    hashes are added once the files are final (``Manifest.with_hashes``)."""
    return Manifest(
        graphs=dict(GRAPH_FILES), input_ids=INPUT_IDS, logits=LOGITS, states=tuple(model.state_specs()),
        vocab_size=model.vocab_size, tokenizer=tokenizer or protocol.tokenizer(model), model=model.model_config(),
        opset=opset, precision=precision, edgelin_version=__version__, source=source, extra=dict(extra or {}),
        logits_dtype=logits_dtype or "float32", prefill_piece=PREFILL_PIECE,  # every precision keeps fp32 logits
        lengths=LENGTHS if ragged else None, logits_at=LOGITS_AT if logits_at else None, max_positions=protocol.max_positions(model),
    )


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
    with _quiet(), torch.no_grad(), fused.lowering(ops), _tracer_settings(), _rewriter_prefilter():
        program = torch.onnx.export(
            module.eval(), example, input_names=inputs, output_names=outputs,
            dynamic_shapes=dynamic, dynamo=True, opset_version=opset, optimize=True, verbose=False,
            custom_translation_table=table,
        )
        try:
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


def _finalize(path: Path, manifest_json: str, graph: str) -> onnx.ModelProto:
    """Embed the manifest in the graph's metadata, name the graph, save, full-check. The weights stay where
    they are (external data beside the graph)."""
    proto = onnx.load(str(path), load_external_data=False)
    _strip_debug_info(proto.graph)
    for fn in proto.functions:
        for node in fn.node:
            del node.metadata_props[:]
            node.doc_string = ""
    del proto.metadata_props[:]
    onnx.helper.set_model_props(proto, {METADATA_KEY: manifest_json})
    proto.graph.name = f"edgelin_{graph}"
    proto.producer_name = "edgelin"
    proto.producer_version = __version__
    onnx.save(proto, str(path))
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except onnx.checker.ValidationError as exc:
        raise ExportError(f"the exported {graph} graph failed onnx.checker: {str(exc).splitlines()[0]}") from None
    return proto


def _golden_run(model, manifest: Manifest, plan: golden.Plan, dtype: torch.dtype = torch.float32) -> tuple[np.ndarray, np.ndarray]:
    """The model's logits on the golden inputs: the whole prompt from a fresh state [BATCH, L, V] and the decode
    steps fed one by one after it [BATCH, steps, V], in ``dtype`` (the model's)."""
    with torch.no_grad():
        logits, state = model(torch.from_numpy(plan.prompt), fresh_state(manifest.states, golden.BATCH, dtype=dtype))
        steps = []
        for t in range(plan.decode.shape[1]):
            step, state = model.step(torch.from_numpy(plan.decode[:, t:t + 1]), state)
            steps.append(step[:, 0])
    return logits.numpy(), torch.stack(steps, 1).numpy()


def _write_golden(plan: golden.Plan, logits: tuple[np.ndarray, np.ndarray], floor: parity.Errors, manifest: Manifest, budget: dict,
                  tmp: Path) -> dict:
    """``golden.json`` (``edgelin.runtime.golden``): the fp32 PyTorch model's logits on the export's fixed inputs
    (``_golden_run``), and the budgets of the export's precision raised to the model's rounding floor on them
    (``floor``: fp32 vs float64; bounds set with --budget kept); returns the manifest's entry for it."""
    budgets = golden.held_budgets(manifest.precision, budget, floor)
    try:
        content = golden.make_golden(plan, *logits, manifest.precision, budgets, floor=floor)
    except ValueError as exc:
        raise ExportError(f"golden outputs: {exc}; the model computes non-finite logits on random ids (check its weights)") from None
    path = tmp / golden.GOLDEN_FILE
    path.write_text(golden.golden_text(content), encoding="utf-8")
    return {"file": golden.GOLDEN_FILE, "sha256": file_sha256(path), "bytes": path.stat().st_size}


def _smoke_reference(model, manifest: Manifest, like: dict[str, Any] | None = None) -> dict[str, Any]:
    """PyTorch's side of the smoke check: a short prompt (batch 2, T = chunk + 3, less where a declared context is
    shorter; a ragged graph: the second row 5 tokens shorter) and SMOKE_STEPS greedy decode steps. Computed right
    after the golden outputs, so that the model is no longer held when the graphs are converted, stored and loaded (an export's peak memory is then not the
    model beside ONNX Runtime's sessions). ``like``: an earlier reference whose ids and decoded tokens are fed
    again (the float64 model's run for the rounding floor: a near-tie must not pick another token)."""
    specs = manifest.states
    dtype = next(model.parameters(), torch.empty(0)).dtype
    if like is None:
        gen = torch.Generator().manual_seed(0)
        T = protocol.chunk_size(model) + 3
        if manifest.max_positions is not None:  # the prompt and its SMOKE_STEPS decode steps inside a declared context
            T = max(1, manifest.min_sequence, min(T, manifest.max_positions - SMOKE_STEPS))
        ids = torch.randint(0, manifest.vocab_size, (2, T), generator=gen)
    else:
        ids = like["ids"]
    T = ids.shape[1]
    lengths = torch.tensor([T, max(T - 5, 1)]) if manifest.lengths else None
    with torch.no_grad():
        ref, state = model(ids, fresh_state(specs, 2, dtype=dtype), **({} if lengths is None else {"lengths": lengths}))
        out = {"ids": ids, "lengths": lengths, "prefill": ref.numpy(), "steps": []}
        for i in range(SMOKE_STEPS):
            nxt = ref[:, -1:].argmax(-1) if like is None else like["steps"][i][0]  # [2, 1]
            ref, state = model.step(nxt, state)
            out["steps"].append((nxt, ref.numpy()))
    return out


def _smoke_floor(reference: dict[str, Any], reference64: dict[str, Any]) -> dict[str, parity.Errors]:
    """The rounding floor of each smoke comparison: PyTorch fp32 vs float64 on its inputs (decode: the worst step)."""
    worst = parity.NONE
    for (_, a), (_, b) in zip(reference["steps"], reference64["steps"]):
        worst = worst.worst(parity.errors(a, b))
    return {"prefill": parity.errors(reference["prefill"], reference64["prefill"]), "decode": worst}


def _smoke_check(reference: dict[str, Any], out: Path, manifest: Manifest) -> dict[str, parity.Errors]:
    """ORT CPU vs ``_smoke_reference``'s PyTorch outputs: logits errors of the prefill and the worst decode step.
    The sessions keep the weights in the file's mapped pages (no prepacking: the check is not timed), shared by
    both."""
    from edgelin.runtime.session import open_session

    sessions = {g: open_session(out / f, "cpu", prepack=False) for g, f in GRAPH_FILES.items()}
    specs = manifest.states
    lengths = reference["lengths"]

    def run(graph: str, x: torch.Tensor, st) -> tuple[np.ndarray, dict]:
        feeds = {name: a.astype(spec.np_dtype, copy=False) for (name, a), spec in zip(to_numpy(specs, st).items(), specs)}
        if graph == "prefill" and lengths is not None:
            feeds[manifest.lengths] = lengths.numpy()
        if graph == "prefill":  # every position's logits, as the reference has
            feeds |= manifest.prefill_positions(*x.shape)
        got = sessions[graph].run([manifest.logits] + [s.output for s in specs], {INPUT_IDS: x.numpy(), **feeds})
        return got[0], from_numpy(specs, {s.input: v for s, v in zip(specs, got[1:])})

    got, ort_state = run("prefill", reference["ids"], fresh_state(specs, 2))
    errors = {"prefill": parity.errors(got, reference["prefill"])}
    worst = parity.NONE
    for nxt, ref in reference["steps"]:
        got, ort_state = run("decode", nxt, ort_state)
        worst = worst.worst(parity.errors(got, ref))
    errors["decode"] = worst
    return errors


def export(
    source: str | Path | torch.nn.Module,
    out_dir: str | Path,
    *,
    opset: int = DEFAULT_OPSET,
    chunk_size: int | None = None,
    force: bool = False,
    check: bool = True,
    progress: Progress | None = None,
    precision: str = "fp32",
    state_dtype: str = "float32",
    ragged: bool = False,
    tokenizer: str | Path | None = None,
    budget: dict[str, dict[str, float]] | None = None,
    embedding: str | None = None,
    int8_scheme: str | None = None,
    ops: str = fused.DEFAULT_LOWERING,
    max_sequence: int = DEFAULT_MAX_SEQUENCE,
    trace_cache: str | Path | None = None,
    logits_at: bool = True,
) -> ExportResult:
    """Export ``source`` (a checkpoint folder, or a model that follows edgelin.protocol) into ``out_dir``;
    see the module docstring. ``precision`` (fp32, fp16, int8, int4) and ``state_dtype`` (float16: fp16
    exports only) are applied to the checked fp32 graphs by ``edgelin.exporters.precision``.

    ``ragged``: the prefill graph takes a third kind of input, ``lengths`` int64 [batch] (the manifest's
    ``lengths``), so prompts of different lengths prefill in one call, right-padded, each row's state exactly
    as if prefilled alone (``Session.prefill_batch``). Needs a model with ``accepts_lengths``. Off by default:
    without it the graphs and manifest are those of every earlier export, which any edgelin/2 client drives.

    ``tokenizer``: a Hugging Face tokenizer (a folder holding ``tokenizer.json``, or the file); by default the
    checkpoint folder's own ``tokenizer.json`` where it has one. It is copied into the export with its
    companion files and described in the manifest (kind ``huggingface``; ``edgelin.exporters.tokenizer``
    says where each special id comes from). Without one the model's own tokenizer entry is kept (bytes for a
    256-id LinearLM, else ``ids``).

    ``budget``: parity bounds of the user's own, {kind: {bound: value}} (``edgelin.parity``), in place of
    edgelin's for the precision: the smoke check is held to them and the manifest records them
    (``parity_budgets``), so that ``edgelin validate`` holds the export to the same.

    ``embedding``: how an int8 or int4 export stores the token embedding and a tied head: "int8" (the
    default), "int4" or "fp32" (``edgelin.exporters.precision``); None for other precisions.

    ``int8_scheme``: an int8 export's weights: "channel" (per-channel weights, one activation scale per tensor, the
    faster prefill) or "block" (8-bit blocks of 32 along K with int8 activations per block, MatMulNBits: closer to
    fp32); recorded as the manifest's ``int8_scheme``. None: "block" for a transformers checkpoint, "channel" for
    any other (``precision.DEFAULT_INT8_SCHEMES``). None for other precisions.

    ``ops``: the graphs' lowering (``edgelin.ops.fused``): "portable" (the default: ONNX standard operators, every
    runtime) or "fused" (linear attention's recurrence as ONNX Runtime's com.microsoft.LinearAttention node;
    recorded as the manifest's ``ops``). The state contract is the same either way.

    ``max_sequence``: the most tokens one prefill call takes, where the prefill graph's size depends on it (the
    portable delta rule's scan across chunks gets log2(max_sequence / chunk) levels, each ~1 s of export per
    layer): the graph is exact up to it and gives NaN beyond, the manifest records it, and the runtimes cut
    longer prompts into pieces of at most that many tokens. Other graphs take any length and record nothing.

    ``trace_cache``: a folder where each traced graph is kept and from which a later export of the same model
    (same weights, code and graph options: ``ragged``, ``logits_at``, ``opset``, ``ops``, ``max_sequence``) takes it instead of
    tracing again, whatever its precision, checks or tokenizer (``edgelin.exporters.traces``). Off by default.

    ``logits_at``: the prefill graph takes the positions whose logits it returns (the manifest's ``logits_at``;
    the runtimes ask for a prompt's last one, so the head runs on one row, not T). False: it
    returns every position's logits, as exports made before that input -- for a client that predates it."""
    say = progress or (lambda _msg: None)
    _check_options(opset, chunk_size, max_sequence)
    if ops not in fused.LOWERINGS:
        raise ExportError(f"ops {ops!r} is not a lowering; choose one of {', '.join(fused.LOWERINGS)}")
    check_precision(precision, state_dtype)
    embedding_choice(precision, embedding)  # one that does not apply is refused before any work
    int8_scheme_choice(precision, int8_scheme)  # one that is not known or does not apply is refused before any work
    budget = {k: dict(v) for k, v in (budget or {}).items()}
    smoke_bounds = parity.held(precision, budget)[0]["logits"]  # a bad bound is refused before any work
    if isinstance(source, (str, os.PathLike, bytes)):  # a path that cannot be one (a NUL in it): one line, before any work
        source = check_path(source, "checkpoint folder", ExportError)
    protect = (source,) if isinstance(source, (str, os.PathLike)) else ()
    replacing = check_output_dir(out_dir, force=force, protect=protect)  # before any work; never a user's folder
    _check_trace_cache(trace_cache, out_dir, protect)
    out_dir = Path(out_dir)
    parent = out_dir.parent if str(out_dir.parent) else Path(".")
    for stale in remove_stale_temps(parent, out_dir.name):
        say(f"removed {stale}, left by an earlier export that was killed")
    tmp, created = work_dir(out_dir)

    try:
        # a checkpoint folder is read once, here: its config and weight files go on as one value
        checkpoint = open_checkpoint(source) if isinstance(source, (str, os.PathLike)) else None
        tokenizer_json = find_tokenizer(checkpoint, tokenizer)
        int8_scheme = int8_scheme_choice(precision, int8_scheme, None if checkpoint is None else upstream.framework_of(checkpoint))
        say(f"loading {source if checkpoint is not None else type(source).__name__}")
        model, digest = _resolve_source(checkpoint or source, chunk_size)
        tok = None if tokenizer_json is None else hf_tokenizer_entry(tokenizer_json, model.vocab_size, checkpoint)
        if tok is not None:
            say(f"tokenizer: {tokenizer_json} (" + ", ".join(f"{k} {tok.spec[k]} from {tok.sources[k]}" for k in ("bos_id", "eos_id", "pad_id") if k in tok.sources)
                + f"; add_bos {tok.spec['add_bos']} from {tok.sources['add_bos']})")
        if state_dtype == "float16":
            protocol.check_float16_state(model)
        if ragged:
            protocol.check_lengths(model)
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
                bounded |= _trace(spec, names, opset, tmp / fname, ops, max_sequence)
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
                        used = _trace(spec, names, opset, tmp / fname, ops, max_sequence)
                        bounded |= used
                        try:
                            cache.store(key, tmp, sorted(p.name for p in tmp.iterdir() if p.name not in before), used)
                        except OSError as exc:
                            say(f"the {graph} graph's trace was not kept in {cache.root}: {exc}")
            seconds[graph] = time.perf_counter() - t0
            del spec  # it holds the model: nothing but ``model`` should, once the reference outputs are made

        protos = {g: onnx.load(str(tmp / f), load_external_data=False) for g, f in GRAPH_FILES.items()}
        if precision == "fp32":  # other precisions rewrite the head once converted (_convert_graphs)
            for g, proto in protos.items():
                if tied_head_in_place(proto):
                    onnx.save(proto, str(tmp / GRAPH_FILES[g]))  # the nodes only: the weights stay in their data file
        nodes = {g: len(p.graph.node) for g, p in protos.items()}
        op_types = {g: _op_histogram(p) for g, p in protos.items()}
        manifest = build_manifest(
            model, opset=opset, source=digest,
            extra={"chunk_size": protocol.chunk_size(model), "nodes": nodes, "state_bytes_per_sequence": 0}, ragged=ragged,
            tokenizer=None if tok is None else tok.spec, logits_at=logits_at,
        )
        manifest = dataclasses.replace(manifest, precision=precision, states=state_dtypes(manifest.states, precision, state_dtype),
                                       max_sequence=max_sequence if bounded else None)
        manifest.extra["state_bytes_per_sequence"] = manifest.state_bytes(1)
        if budget:
            manifest.extra["parity_budgets"] = budget
        if ops != fused.DEFAULT_LOWERING:  # absent: the portable graphs every earlier export has
            manifest.extra["ops"] = ops
        say("golden outputs: the PyTorch model on fixed inputs ...")
        plan = golden.plan_for(manifest.vocab_size, protocol.chunk_size(model), manifest.min_sequence, max_positions=manifest.max_positions)
        gold = _golden_run(model, manifest, plan)
        reference = _smoke_reference(model, manifest) if check else None
        caller = None if checkpoint is not None else model  # the caller holds it anyway; a checkpoint's is loaded again if needed
        model = None  # not needed past here: an export from a checkpoint frees its weights before ONNX Runtime loads them
        manifest.extra["golden"] = _write_golden(plan, gold, None, manifest, budget, tmp)
        if precision != "fp32":  # torch's graphs are checked before they are converted
            say("checking the fp32 graphs (onnx.checker, full check) ...")
            for graph in GRAPH_FILES:
                _finalize(tmp / GRAPH_FILES[graph], manifest.to_json(embedded=True), graph)
            nodes, op_types = _convert_graphs(tmp, precision, state_dtype, manifest, say, embedding=embedding, int8_scheme=int8_scheme)
        manifest = dataclasses.replace(manifest, weights=store_once(tmp, GRAPH_FILES))
        say(f"weights stored once: {manifest.weights['file']}, {manifest.weights['bytes'] / 1e6:,.1f} MB, shared by both graphs")
        say("checking the graphs (onnx.checker, full check) ...")
        manifest = _publish_manifest(tmp, manifest, tok)

        smoke, smoke_held = None, {}
        if check:
            say("smoke check: ONNX Runtime (CPU) vs PyTorch ...")
            smoke, gold_worst = _smoke_check(reference, tmp, manifest), _golden_worst(tmp, manifest)
            smoke_held = {k: smoke_bounds for k in smoke}
            floors: dict[str, parity.Errors] = {}
            if precision == "fp32" and not all(parity.within(e, smoke_bounds) for e in (*smoke.values(), gold_worst)):
                # out of edgelin's budget: is that the model's own fp32 rounding? Measured only here, where it is
                # needed (the model in float64 is twice its fp32 weights). fp16: the checkpoint's framework at fp16,
                # below; int8 and int4 rounding is what their budgets (0.3 and up) are set for
                say("out of edgelin's fp32 budget: the model's rounding floor, the same inputs in float64 ...")
                floor, floors = _rounding_floor(checkpoint, caller, chunk_size, manifest, plan, gold, reference, say)
                smoke_held = {k: parity.floored(smoke_bounds, floors.get(k), keep=budget.get("logits", {})) for k in smoke}
                if floor is not None:  # golden.json's budgets raised to it, and everything that records its hash again
                    manifest.extra["golden"] = _write_golden(plan, gold, floor, manifest, budget, tmp)
                    manifest = _publish_manifest(tmp, manifest, tok)
            peer = None
            if precision in upstream.PRECISION_DTYPES and checkpoint is not None \
                    and not all(parity.within(e, smoke_bounds) for e in smoke.values()):
                # out of edgelin's budget: is the checkpoint's own framework, run at this precision, as far off?
                peer = _precision_floor(checkpoint, precision, reference, say)
                if peer is not None:
                    smoke_held = {k: parity.floored(smoke_bounds, peer.errors, keep=budget.get("logits", {}), factor=upstream.PRECISION_FACTOR)
                                  for k in smoke}
                    manifest.extra["precision_floor"] = peer.record()  # validate holds the export to the same
                    manifest = _publish_manifest(tmp, manifest, tok)
            bad = {k: e for k, e in smoke.items() if not parity.within(e, smoke_held[k])}
            if bad:
                raise ExportError(
                    "smoke check failed: " + ", ".join(f"{k} max abs error {e.max_abs:.2e} (max rel {e.max_rel:.2e}, rel L2 {e.rel_l2:.2e};"
                                                       f" budget {_said_bounds(smoke_held[k])}"
                                                       + (f", PyTorch fp32 itself {floors[k].max_rel:.1e} / {floors[k].rel_l2:.1e} from float64"
                                                          if k in floors else "")
                                                       + (f", {peer.said()}" if peer is not None else "") + ")"
                                                       for k, e in bad.items())
                    + "; run `edgelin validate` on an export made with --no-check to see where, "
                    "or state a budget of your own with --budget"
                )
        files = {p.name: p.stat().st_size for p in work_files(tmp)}
        if replacing:
            say(f"replacing {out_dir}: {replacing}")
        replace_dir(tmp, out_dir, force=force, protect=protect)
    except BaseException as exc:
        full = write_failure(exc, tmp)  # before the files go: their sizes tell a file-size limit
        with uninterrupted():  # a second Ctrl-C does not leave the work folder half removed
            shutil.rmtree(tmp, ignore_errors=True)
            clean = not tmp.exists() and remove_created(created)
        if isinstance(exc, (EdgelinError, KeyboardInterrupt, SystemExit)):
            raise
        left = "nothing was written" if clean else f"remove {tmp} by hand"
        if full is not None:
            raise ExportError(f"export failed: {full}, while writing {out_dir}; make room (or raise the limit) and export again; {left}") from None
        raise ExportError(f"export failed ({_cause(exc)}); {left}") from exc
    return ExportResult(out_dir=out_dir, manifest=manifest, files=files, nodes=nodes, seconds=seconds, smoke=smoke, op_types=op_types,
                        smoke_bounds=smoke_held)


def _check_trace_cache(trace_cache, out_dir, protect: tuple) -> None:
    """A trace cache is a folder of its own: not a file, not inside the export or the checkpoint, nor around them."""
    if trace_cache is None:
        return
    cache = check_path(trace_cache, "trace cache folder", ExportError).resolve()
    if cache.exists() and not cache.is_dir():
        raise ExportError(f"trace cache {trace_cache} is a file; give a folder (it is made if missing)")
    for other, what in [(Path(out_dir).resolve(), "the export's folder"), *[(Path(p).resolve(), "the checkpoint") for p in protect]]:
        if cache == other or other in cache.parents or cache in other.parents:
            raise ExportError(f"trace cache {trace_cache} overlaps {what} ({other}); give a folder of its own")


def _trace(spec, names, opset: int, path: Path, ops: str, max_sequence: int) -> bool:
    """Trace one graph into ``path``; True where its graph depends on ``max_sequence``."""
    with sequence_bound(max_sequence) as bound:
        export_graph(spec.module, spec.example, names, spec.dynamic_shapes, opset, path, external=True, ops=ops)
    return bound.used


def _publish_manifest(tmp: Path, manifest: Manifest, tok) -> Manifest:
    """Embed the manifest in both graphs (full check), hash the files and write edgelin.json; the tokenizer's files
    copied first. Run again when golden.json changes (its hash is in both copies)."""
    embedded_json = manifest.to_json(embedded=True)  # the graphs' copy: no hashes (a file cannot hold its own)
    for graph in GRAPH_FILES:
        _finalize(tmp / GRAPH_FILES[graph], embedded_json, graph)
    for name, path in ({} if tok is None else tok.files).items():
        if not (tmp / name).exists():
            shutil.copyfile(path, tmp / name)
        if file_sha256(tmp / name) != tok.spec["files"][name]:
            raise ExportError(f"{path} changed while it was being exported; export again")
    manifest = manifest.with_hashes(tmp)
    (tmp / MANIFEST_FILE).write_text(manifest.to_json(), encoding="utf-8")
    return manifest


def _golden_worst(tmp: Path, manifest: Manifest) -> parity.Errors:
    """ONNX Runtime (CPU) on golden.json's inputs against its rows: the worst logits errors (lower bounds where the
    file stores part of a row: ``golden.row_errors``)."""
    from edgelin.runtime.session import Session

    gold = golden.Golden.load(tmp, manifest)
    rows = golden.run_plan(Session(tmp, provider="cpu", prepack=False, check_hashes=False), gold.plan)
    worst = parity.NONE
    for got, row in zip(rows, gold.rows):
        worst = worst.worst(golden.row_errors(got, row))
    return worst


def _precision_floor(checkpoint, precision: str, reference: dict[str, Any], say) -> "upstream.PrecisionFloor | None":
    """The checkpoint's own framework at ``precision`` against its float64 run, on the smoke check's prompt (both rows
    whole) and its decode steps; None, said, where there is no such framework or it cannot run here."""
    framework = upstream.framework_of(checkpoint)
    why = "edgelin's own checkpoint" if framework is None else upstream.unavailable(framework)
    if why is None and framework not in upstream.PRECISION_FRAMEWORKS:
        why = f"{framework} runs its models in float32 only here"
    if why is None:
        say(f"out of edgelin's {precision} budget: {upstream.possessive(framework)} own model at {precision} and in float64 on the same ids, in a subprocess ...")
        try:
            steps = np.concatenate([np.asarray(nxt) for nxt, _ in reference["steps"]], axis=1)  # [B, 4]: the smoke's decoded tokens
            return upstream.precision_floor(checkpoint.path, framework, precision, np.asarray(reference["ids"]), steps)
        except upstream.UpstreamError as exc:
            why = str(exc)
    say(f"{precision} precision floor not measured ({why}); edgelin's budget applies as it is")
    return None


def _rounding_floor(checkpoint, caller, chunk_size, manifest: Manifest, plan, gold, reference, say) -> tuple[parity.Errors | None, dict[str, parity.Errors]]:
    """(floor of the golden outputs, floor of each smoke comparison): the fp32 references against the same model in
    float64 (a checkpoint loaded again, a caller's module copied: never changed). (None, {}) for a module that
    does not run in float64."""
    try:
        model = _resolve_source(checkpoint, chunk_size)[0] if caller is None else copy.deepcopy(caller)
        model = model.double()
        gold64 = _golden_run(model, manifest, plan, torch.float64)
        floors = _smoke_floor(reference, _smoke_reference(model, manifest, like=reference))
    except (RuntimeError, TypeError, ValueError) as exc:  # a module of the caller's that computes in float32 only
        say(f"rounding floor not measured (the model does not run in float64: {_cause(exc)}); edgelin's budgets apply as they are")
        return None, {}
    floor = parity.errors(np.concatenate([g.reshape(-1) for g in gold]), np.concatenate([g.reshape(-1) for g in gold64]))
    return floor, floors


def _said_bounds(bounds: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1e}" for k, v in bounds.items())


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _cause(exc: BaseException) -> str:
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


def _convert_graphs(tmp: Path, precision: str, state_dtype: str, manifest: Manifest, say: Progress, embedding: str | None = None,
                    int8_scheme: str | None = None) -> tuple[dict, dict]:
    """The checked fp32 graphs in ``tmp`` rewritten in ``precision`` (``int8_scheme``: as ``int8_scheme_choice``
    resolved it); the manifest's extra fields record
    the node counts and what stayed in higher precision. Returns (nodes, op types) per graph."""
    say(f"converting the graphs to {precision}" + (f" (state {state_dtype})" if precision == "fp16" else "") + " ...")
    nodes, op_types, kept = {}, {}, {}
    for graph, fname in GRAPH_FILES.items():
        if precision == "int8":  # the quantiser reads the file itself: no second copy of the weights in memory
            proto, note = int8_file(tmp / fname, embedding_choice(precision, embedding), int8_scheme)
        else:
            proto, note = convert_precision(load_graph(tmp / fname), precision, state_dtype=state_dtype, embedding=embedding)
        tied_head_in_place(proto)
        save_graph(proto, tmp / fname)
        nodes[graph], op_types[graph], kept[graph] = len(proto.graph.node), _op_histogram(proto), note.kept
    manifest.extra.update(nodes=nodes, precision_kept=kept, state_bytes_per_sequence=manifest.state_bytes(1))
    if precision == "int8":
        manifest.extra["int8_scheme"] = int8_scheme
    if precision in ("int8", "int4"):  # how the token table is stored: validate's quantised reference reads it
        manifest.extra["embedding"] = embedding_choice(precision, embedding)
    return nodes, op_types


def _strip_debug_info(graph: onnx.GraphProto) -> None:
    """Drop the exporter's per-node debug metadata: it holds memory addresses (so two exports of the same
    model would differ byte for byte) and source paths, and nothing a runtime reads."""
    for node in graph.node:
        del node.metadata_props[:]
        node.doc_string = ""
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                _strip_debug_info(attr.g)
            for sub in attr.graphs:
                _strip_debug_info(sub)
    for group in (graph.input, graph.output, graph.value_info, graph.initializer):
        for item in group:
            del item.metadata_props[:]
            item.doc_string = ""
    del graph.metadata_props[:]


def _op_histogram(proto: onnx.ModelProto) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in proto.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return dict(sorted(counts.items()))


__all__ = ["DEFAULT_OPSET", "ExportResult", "GRAPH_FILES", "build_manifest", "export", "export_graph"]
