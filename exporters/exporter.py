"""A model -> ``prefill.onnx`` + ``decode.onnx`` + ``edgelin.json``, written atomically.

The model is anything that follows the model protocol (``edgelin.protocol``): edgelin's ``LinearLM``, a
model imported from a foreign checkpoint, or the user's own module.

Everything is written into a temporary folder beside the destination and moved into place only after
both graphs exported, passed ``onnx.checker`` (full check) and, unless ``check=False``, a smoke
comparison of ONNX Runtime (CPU) against PyTorch. A failure leaves nothing behind.

The phases, one module each: ``source`` (the model), ``tracing`` (both graphs), ``check`` (golden outputs, the
smoke check and its floors), ``convert`` (the precision), ``write`` (the manifest, the finalised graphs) and
``result`` (what is returned and its summary); ``export`` here runs them in order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import shutil
from pathlib import Path
from typing import Callable

import onnx
import torch

from edgelin import parity, protocol, streaming, upstream
from edgelin.checkpoint import open_checkpoint
from edgelin.errors import EdgelinError, ExportError
from edgelin.exporters.check import (
    golden_run, golden_worst, precision_floor, rounding_floor, smoke_check, smoke_reference, write_golden,
)
from edgelin.exporters import deferred
from edgelin.exporters.convert import convert_graph, op_histogram, record_conversion
from edgelin.exporters.precision import check_precision, embedding_choice, int8_scheme_choice, state_dtypes
from edgelin.exporters.precision.int4 import eight_bit_digests
from edgelin.exporters.result import ExportResult, OwnMemoryPeak, peak_resident
from edgelin.exporters.source import check_disk, check_largest_tensor, resolve_source
from edgelin.exporters.tokenizer import find_tokenizer, hf_tokenizer_entry
from edgelin.exporters.tracing import export_graph, failure_cause, trace_graphs
from edgelin.exporters.weights import Reuse, store_once, tied_head_in_place
from edgelin.exporters.write import GRAPH_FILES, build_manifest, publish_manifest
from edgelin.ops import fused
from edgelin.ops.delta import DEFAULT_MAX_SEQUENCE
from edgelin.quantref import eight_bit_linears
from edgelin.runtime import golden
from edgelin.runtime.files import check_output_dir, check_path, remove_created, remove_stale_temps, replace_dir, uninterrupted, work_dir, work_files, write_failure

MIN_OPSET, MAX_OPSET = 18, 23  # the default exporter's lowest opset .. the newest ORT 1.2x runs
DEFAULT_OPSET = 18  # the most portable: older edge runtimes read it
MAX_CHUNK = 4096
MAX_SEQUENCE_LIMIT = 1 << 31  # the manifest's bound on max_sequence

Progress = Callable[[str], None]


def _check_options(opset: int, chunk_size: int | None, max_sequence: int = DEFAULT_MAX_SEQUENCE) -> None:
    if not isinstance(opset, int) or not MIN_OPSET <= opset <= MAX_OPSET:
        raise ExportError(f"opset {opset!r} is not supported; choose {MIN_OPSET}..{MAX_OPSET} (default {DEFAULT_OPSET})")
    if isinstance(max_sequence, bool) or not isinstance(max_sequence, int) or not 1 <= max_sequence <= MAX_SEQUENCE_LIMIT:
        raise ExportError(f"max sequence {max_sequence!r} is out of range; choose 1..{MAX_SEQUENCE_LIMIT} tokens per prefill call "
                          f"(default {DEFAULT_MAX_SEQUENCE})")
    if chunk_size is not None and (not isinstance(chunk_size, int) or not 1 <= chunk_size <= MAX_CHUNK):
        raise ExportError(f"chunk size {chunk_size!r} is out of range; choose 1..{MAX_CHUNK} (64 is a good default)")


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
    streamed: bool | None = None,
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
    returns every position's logits, as exports made before that input -- for a client that predates it.

    ``streamed``: a checkpoint folder's weights are read one tensor at a time into a scratch file in the export's work
    folder and mapped from it (``edgelin.streaming``), not held in memory: the export's own memory is then bounded by
    its graphs and activations and the largest tensor, whatever the model's size; the files written are the same
    bytes. A checkpoint whose largest tensor cannot fit in the memory available is refused before any work. None (the
    default): streamed for a checkpoint folder; a model passed in as a module is in memory already (refused with
    ``streamed=True``). False: a checkpoint's weights loaded into memory, the scratch file's disk space spared."""
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
    if streamed is None:
        streamed = bool(protect)
    if streamed and not protect:
        raise ExportError("a streamed export reads a checkpoint folder; save the model with save_checkpoint and export the folder, "
                          "or export the module without streamed")
    replacing = check_output_dir(out_dir, force=force, protect=protect)  # before any work; never a user's folder
    _check_trace_cache(trace_cache, out_dir, protect)
    out_dir = Path(out_dir)
    parent = out_dir.parent if str(out_dir.parent) else Path(".")
    for stale in remove_stale_temps(parent, out_dir.name):
        say(f"removed {stale}, left by an earlier export that was killed")
    tmp, created = work_dir(out_dir)
    own = OwnMemoryPeak().start()
    held = contextlib.ExitStack()  # the traced weights left unwritten until stored (edgelin.exporters.deferred)

    try:
        # a checkpoint folder is read once, here: its config and weight files go on as one value
        checkpoint = open_checkpoint(source) if isinstance(source, (str, os.PathLike)) else None
        if streamed:
            check_largest_tensor(checkpoint)
        tokenizer_json = find_tokenizer(checkpoint, tokenizer)
        int8_scheme = int8_scheme_choice(precision, int8_scheme, None if checkpoint is None else upstream.framework_of(checkpoint))
        say(f"loading {source if checkpoint is not None else type(source).__name__}")
        with streaming.mapped_weights(tmp) if streamed else contextlib.nullcontext():
            model, digest = resolve_source(checkpoint or source, chunk_size)
        check_disk(model, tmp, precision)  # before the trace
        tok = None if tokenizer_json is None else hf_tokenizer_entry(tokenizer_json, model.vocab_size, checkpoint)
        if tok is not None:
            say(f"tokenizer: {tokenizer_json} (" + ", ".join(f"{k} {tok.spec[k]} from {tok.sources[k]}" for k in ("bos_id", "eos_id", "pad_id") if k in tok.sources)
                + f"; add_bos {tok.spec['add_bos']} from {tok.sources['add_bos']})")
        if state_dtype == "float16":
            protocol.check_float16_state(model)
        if ragged:
            protocol.check_lengths(model)
        converted: dict = {}  # graph -> (converted graph, notes): each converted once traced, before the next writes its weights
        eight_bit = eight_bit_digests(eight_bit_linears(model)) if precision == "int4" else frozenset()
        reuse = Reuse()  # a weight converted in the prefill graph is referred to from the decode graph, not written again
        convert = None if precision == "fp32" else lambda graph: converted.__setitem__(graph, convert_graph(
            tmp, graph, precision, state_dtype, say, embedding=embedding, int8_scheme=int8_scheme, eight_bit=eight_bit, reuse=reuse))
        held.enter_context(deferred.deferring(model))
        seconds, bounded = trace_graphs(model, tmp, ragged=ragged, logits_at=logits_at, opset=opset, ops=ops, max_sequence=max_sequence,
                                        trace_cache=trace_cache, say=say, after=convert)
        if convert is not None:  # converted as traced: nothing reads the traced weights again, the parameters can go
            held.close()

        protos = {g: onnx.load(str(tmp / f), load_external_data=False) for g, f in GRAPH_FILES.items()}
        if precision == "fp32":  # other precisions rewrite the head once converted (convert_graphs)
            for g, proto in protos.items():
                if tied_head_in_place(proto):
                    onnx.save(proto, str(tmp / GRAPH_FILES[g]))  # the nodes only: the weights stay in their data file
        nodes = {g: len(p.graph.node) for g, p in protos.items()}
        op_types = {g: op_histogram(p) for g, p in protos.items()}
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
        gold = golden_run(model, manifest, plan)
        reference = smoke_reference(model, manifest) if check else None
        caller = None if checkpoint is not None else model  # the caller holds it anyway; a checkpoint's is loaded again if needed
        model = None  # not needed past here: an export from a checkpoint frees its weights before ONNX Runtime loads them
        if streamed:  # and its scratch file's disk before the store writes the weights file (a module's cycles hold its mapping)
            gc.collect()
        manifest.extra["golden"] = write_golden(plan, gold, None, manifest, budget, tmp)
        if converted:  # torch's graphs were checked, then converted, as each was traced
            nodes, op_types = record_conversion(converted, precision, manifest, say, embedding=embedding, int8_scheme=int8_scheme)
        manifest = dataclasses.replace(manifest, weights=store_once(tmp, GRAPH_FILES))
        held.close()
        say(f"weights stored once: {manifest.weights['file']}, {manifest.weights['bytes'] / 1e6:,.1f} MB, shared by both graphs")
        say("checking the graphs (onnx.checker, full check) ...")
        manifest = publish_manifest(tmp, manifest, tok)

        smoke, smoke_held = None, {}
        if check:
            say("smoke check: ONNX Runtime (CPU) vs PyTorch ...")
            smoke, gold_worst = smoke_check(reference, tmp, manifest), golden_worst(tmp, manifest)
            if reference.get("set_aside"):
                say(f"smoke check: {reference['set_aside']} token(s) whose experts the graphs choose otherwise (a near tie) set aside")
            smoke_held = {k: smoke_bounds for k in smoke}
            floors: dict[str, parity.Errors] = {}
            if precision == "fp32" and not all(parity.within(e, smoke_bounds) for e in (*smoke.values(), gold_worst)):
                # out of edgelin's budget: is that the model's own fp32 rounding? Measured only here, where it is
                # needed (the model in float64 is twice its fp32 weights). fp16: the checkpoint's framework at fp16,
                # below; int8 and int4 rounding is what their budgets (0.3 and up) are set for
                say("out of edgelin's fp32 budget: the model's rounding floor, the same inputs in float64 ...")
                floor, floors = rounding_floor(checkpoint, caller, chunk_size, manifest, plan, gold, reference, say,
                                               scratch=tmp if streamed else None)
                smoke_held = {k: parity.floored(smoke_bounds, floors.get(k), keep=budget.get("logits", {})) for k in smoke}
                if floor is not None:  # golden.json's budgets raised to it, and everything that records its hash again
                    manifest.extra["golden"] = write_golden(plan, gold, floor, manifest, budget, tmp)
                    manifest = publish_manifest(tmp, manifest, tok)
            peer = None
            if precision in upstream.PRECISION_DTYPES and checkpoint is not None \
                    and not all(parity.within(e, smoke_bounds) for e in smoke.values()):
                # out of edgelin's budget: is the checkpoint's own framework, run at this precision, as far off?
                peer = precision_floor(checkpoint, precision, reference, say)
                if peer is not None:
                    smoke_held = {k: parity.floored(smoke_bounds, peer.errors, keep=budget.get("logits", {}), factor=upstream.PRECISION_FACTOR)
                                  for k in smoke}
                    manifest.extra["precision_floor"] = peer.record()  # validate holds the export to the same
                    manifest = publish_manifest(tmp, manifest, tok)
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
        with contextlib.suppress(OSError):  # unlinked once mapped where the system allows (edgelin.streaming)
            (tmp / streaming.SCRATCH_FILE).unlink(missing_ok=True)
        files = {p.name: p.stat().st_size for p in work_files(tmp)}
        if replacing:
            say(f"replacing {out_dir}: {replacing}")
        replace_dir(tmp, out_dir, force=force, protect=protect)
    except BaseException as exc:
        held.close()
        own.stop()
        full = write_failure(exc, tmp)  # before the files go: their sizes tell a file-size limit
        with uninterrupted():  # a second Ctrl-C does not leave the work folder half removed
            shutil.rmtree(tmp, ignore_errors=True)
            clean = not tmp.exists() and remove_created(created)
        if isinstance(exc, (EdgelinError, KeyboardInterrupt, SystemExit)):
            raise
        left = "nothing was written" if clean else f"remove {tmp} by hand"
        if full is not None:
            raise ExportError(f"export failed: {full}, while writing {out_dir}; make room (or raise the limit) and export again; {left}") from None
        raise ExportError(f"export failed ({failure_cause(exc)}); {left}") from exc
    return ExportResult(out_dir=out_dir, manifest=manifest, files=files, nodes=nodes, seconds=seconds, smoke=smoke, op_types=op_types,
                        smoke_bounds=smoke_held, peak_bytes=peak_resident(), peak_own_bytes=own.stop(), streamed=streamed)


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


def _said_bounds(bounds: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1e}" for k, v in bounds.items())


__all__ = ["DEFAULT_OPSET", "ExportResult", "GRAPH_FILES", "build_manifest", "export", "export_graph"]
