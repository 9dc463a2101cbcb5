"""The graphs the bench exports itself, and their check against PyTorch before anything is timed.

    linear           the model's own export (prefill + decode + manifest), unless an export folder was given
    parallel         the prefill graph of LinearLM's quadratic masked form (form="parallel"), O(T^2) memory
    chunk{C}         the prefill graph with chunk C (``with_chunk_size``), for the chunk sweep
    softmax_prefill  the softmax twin: a SoftmaxLM of the LinearLM's widths (RoPE, random weights) ...
    softmax_decode   ... and its decode step with a KV cache (past k/v of dynamic length in, present out)
    softmax_gqa      ... and its decode step around ORT's GroupQueryAttention, KV buffers updated in place (``gqa``)

The twin and the quadratic form exist for a ``LinearLM`` only (the twin is built from its config);
for any other model that follows ``edgelin.protocol`` they are skipped, with the reason in the report.
A LinearLM's graphs are exported in up to two worker processes (``python -m edgelin.bench --export
JOBS``), which rebuild the models from the config and the saved weights; another model is exported in
this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from torch import nn

from edgelin import parity
from edgelin.config import ModelConfig
from edgelin.exporters.exporter import DEFAULT_OPSET, export, export_graph
from edgelin.exporters.graphs import INPUT_IDS, LOGITS, example_positions, graph_spec
from edgelin.model import LinearLM
from edgelin.protocol import chunk_size
from edgelin.runtime.files import write_json
from edgelin.runtime.manifest import LOGITS_AT, POSITIONS, positions_feed
from edgelin.runtime.providers import open_session
from edgelin.softmax import SoftmaxLM
from edgelin.state import fresh_state, to_numpy

from . import gqa
from .gqa import kv_keys
from .measure import session_options
from .plan import DATA_SEED, MODEL_SEED, SOFTMAX_SEED, BenchError, Progress, Subject

PRECISION = "fp32"  # every graph exported here is float32
EXPORT_COST = {"linear": 3, "parallel": 2, "chunk": 2, "softmax_prefill": 1, "softmax_decode": 1, "softmax_gqa": 0, "fla": 3}  # rough relative export times
NOT_LINEAR_LM = "the model is not a LinearLM ({}): the softmax twin and the O(T^2) form are built from a LinearLM's config"


# ---- the softmax twin ----------------------------------------------------------------------------
class SoftmaxPrefill(nn.Module):
    """input_ids [B, T], logits_at [B, P] -> logits [B, P, V] (as edgelin's prefill graphs: a prompt needs its
    last position's), present.{i}.k/v [B, H, T, Dh] (the KV cache)."""

    def __init__(self, model: SoftmaxLM) -> None:
        super().__init__()
        self.model = model
        self.keys = kv_keys(model.cfg.n_layers)

    def forward(self, input_ids: torch.Tensor, logits_at: torch.Tensor):
        logits, cache = self.model(input_ids, None, logits_at)
        return (logits, *(cache[k] for k in self.keys))


class SoftmaxDecode(nn.Module):
    """input_ids [B, 1], past.{i}.k/v [B, H, P, Dh] -> logits [B, 1, V], present.{i}.k/v [B, H, P + 1, Dh]."""

    def __init__(self, model: SoftmaxLM) -> None:
        super().__init__()
        self.model = model
        self.keys = kv_keys(model.cfg.n_layers)

    def forward(self, input_ids: torch.Tensor, *past: torch.Tensor):
        logits, cache = self.model(input_ids, dict(zip(self.keys, past)))
        return (logits, *(cache[k] for k in self.keys))


def softmax_twin(subject: Subject) -> tuple[SoftmaxLM | None, str | None]:
    """(the twin, None) for a LinearLM, else (None, why there is none)."""
    if not subject.is_linear_lm:
        return None, NOT_LINEAR_LM.format(type(subject.model).__name__)
    torch.manual_seed(SOFTMAX_SEED)
    return SoftmaxLM(subject.model.cfg).float().eval(), None


# ---- exporting ----------------------------------------------------------------------------------
def plan_exports(subject: Subject, sections: tuple[str, ...], sweep_chunks: list[int], work: Path, kv_capacity: int = 0) -> list[dict[str, Any]]:
    """The export jobs the sections need: {"name", "kind", "path", "opset"} (+ "chunk", + "capacity": the longest
    sequence the KV-buffer graph serves; without one it is not built)."""
    base = {"opset": subject.opset}
    jobs = []
    if subject.export_dir is None:
        jobs.append({**base, "name": "linear", "kind": "linear", "path": str(work / "linear")})
    if subject.is_linear_lm:
        if "position" in sections:
            jobs.append({**base, "name": "softmax_decode", "kind": "softmax_decode", "path": str(work / "softmax_decode.onnx")})
            if kv_capacity and not gqa.unsupported(subject.model.cfg):
                jobs.append({**base, "name": "softmax_gqa", "kind": "softmax_gqa", "capacity": kv_capacity, "path": str(work / "softmax_gqa.onnx")})
        if "prefill" in sections:
            jobs.append({**base, "name": "softmax_prefill", "kind": "softmax_prefill", "path": str(work / "softmax_prefill.onnx")})
            jobs.append({**base, "name": "parallel", "kind": "parallel", "path": str(work / "parallel.onnx")})
    if "sweep" in sections:
        own = chunk_size(subject.model)
        jobs += [{**base, "name": f"chunk{c}", "kind": "chunk", "chunk": c, "path": str(work / f"chunk{c}.onnx")}
                 for c in sweep_chunks if c != own]
    return jobs


def export_one(model: nn.Module, job: dict[str, Any]) -> dict[str, Any]:
    """Export one graph of ``model`` (the twin for softmax jobs). Returns {"seconds": ..., "nodes": ...}."""
    kind, path, opset = job["kind"], Path(job["path"]), job["opset"]
    t0 = time.perf_counter()
    if kind == "linear":
        result = export(model, path, opset=opset, force=True, check=True)
        return {"seconds": time.perf_counter() - t0, "nodes": result.nodes}
    if kind == "fla":  # an imported fla model (fla_models.build_fla), exact up to one call of max_sequence tokens
        result = export(model, path, opset=opset, force=True, check=True, max_sequence=job["max_sequence"])
        return {"seconds": time.perf_counter() - t0, "nodes": result.nodes, "parameters": sum(p.numel() for p in model.parameters())}
    batch = torch.export.Dim("batch", min=1, max=1 << 16)
    if kind in ("parallel", "chunk"):
        if kind == "chunk":
            model = model.with_chunk_size(job["chunk"]).eval()
        spec = graph_spec(model, "prefill", form="parallel" if kind == "parallel" else None, logits_at=True)  # the quadratic form, or chunked
        export_graph(spec.module, spec.example, (spec.input_names, spec.output_names), spec.dynamic_shapes, opset, path)
    elif kind == "softmax_prefill":
        keys = kv_keys(model.cfg.n_layers)
        names = ([INPUT_IDS, LOGITS_AT], [LOGITS] + [f"present.{k}" for k in keys])
        sequence = torch.export.Dim("sequence", min=1, max=1 << 24)
        positions = torch.export.Dim(POSITIONS, min=1, max=1 << 24)
        example = (torch.zeros(2, 37, dtype=torch.int64), example_positions(37))
        export_graph(SoftmaxPrefill(model), example, names, ({0: batch, 1: sequence}, {0: batch, 1: positions}), opset, path)
    elif kind == "softmax_decode":
        keys = kv_keys(model.cfg.n_layers)
        past_len = torch.export.Dim("past", min=1, max=1 << 24)
        names = ([INPUT_IDS] + [f"past.{k}" for k in keys], [LOGITS] + [f"present.{k}" for k in keys])
        past = [torch.zeros(2, model.cfg.n_heads, 11, model.cfg.head_dim) for _ in keys]
        example = (torch.zeros(2, 1, dtype=torch.int64), *past)
        dynamic = ({0: batch}, tuple({0: batch, 2: past_len} for _ in keys))
        export_graph(SoftmaxDecode(model), example, names, dynamic, opset, path)
    elif kind == "softmax_gqa":
        gqa.write_decode_graph(model, path, job["capacity"], opset)
    else:  # pragma: no cover -- internal
        raise ValueError(f"unknown export job {kind!r}")
    nodes = len(onnx.load(str(path), load_external_data=False).graph.node)
    return {"seconds": time.perf_counter() - t0, "nodes": {kind: nodes}}


def _rebuild(job: dict[str, Any]) -> nn.Module:
    """The job's model, rebuilt in a worker from the config and the saved weights (an fla job's: built with fla)."""
    if job["kind"] == "fla":
        from .fla_models import build_fla

        return build_fla(job)
    cls = SoftmaxLM if job["kind"].startswith("softmax") else LinearLM
    model = cls(ModelConfig.from_dict(job["config"]))
    with np.load(job["weights"]) as weights:
        model.load_state_dict({k: torch.from_numpy(weights[k]) for k in weights.files})
    return model.float().eval()


def export_worker_main(jobs_file: str) -> None:
    """Run a list of export jobs in this process (torch.onnx's warm-up is paid once per worker)."""
    torch.set_num_threads(1)
    jobs = json.loads(Path(jobs_file).read_text(encoding="utf-8"))
    results = {job["name"]: export_one(_rebuild(job), job) for job in jobs}
    write_json(Path(jobs_file).with_suffix(".result.json"), results)


def run_exports(jobs: list[dict[str, Any]], subject: Subject, twin: SoftmaxLM | None, work: Path, say: Progress) -> dict[str, dict]:
    """Run the export jobs: a LinearLM's in up to two worker processes, balanced by cost; another model's here."""
    if not jobs:
        return {}
    if not subject.is_linear_lm:
        say(f"exporting {len(jobs)} graph job(s) ({', '.join(j['name'] for j in jobs)}) in this process; ~10 s per graph ...")
        t0 = time.perf_counter()
        try:
            results = {job["name"]: export_one(subject.model, job) for job in jobs}
        except Exception as exc:  # noqa: BLE001 -- any exporter failure, said in one line
            raise BenchError(f"exporting the benchmark graphs failed: {(str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]}") from exc
        say(f"  exports done in {time.perf_counter() - t0:.1f} s")
        return results
    recipes = {"linear": (subject.model, work / "linear-weights.npz"), "softmax": (twin, work / "softmax-weights.npz")}
    for model, path in recipes.values():
        if model is not None:
            np.savez(path, **{k: v.detach().numpy() for k, v in model.state_dict().items()})
    config = subject.model.cfg.to_dict()
    jobs = [{**job, "config": config, "weights": str(recipes["softmax" if job["kind"].startswith("softmax") else "linear"][1])} for job in jobs]
    return _in_workers(jobs, work, say)


def export_linear_models(configs: dict[str, ModelConfig], work: Path, say: Progress) -> tuple[dict[str, dict], dict[str, int]]:
    """One LinearLM per named config (random weights, seed MODEL_SEED), exported and checked into ``work / name`` by
    the export workers (rebuilt there from config + weights): (per name, the worker's result: nodes, seconds; per
    name, the parameter count). The decay and hybrid sections' models."""
    jobs, parameters = [], {}
    for name, cfg in configs.items():
        torch.manual_seed(MODEL_SEED)
        model = LinearLM(cfg).float().eval()
        parameters[name] = sum(p.numel() for p in model.parameters())
        weights = work / f"{name}-weights.npz"
        np.savez(weights, **{k: v.detach().numpy() for k, v in model.state_dict().items()})
        jobs.append({"name": name, "kind": "linear", "path": str(work / name), "opset": DEFAULT_OPSET,
                     "config": cfg.to_dict(), "weights": str(weights)})
    return _in_workers(jobs, work, say), parameters


def export_fla_models(jobs: list[dict[str, Any]], work: Path, say: Progress) -> dict[str, dict]:
    """fla models built with fla, imported and exported with the check by the export workers (jobs of kind "fla":
    fla_models.build_fla): per name, the worker's result (nodes, seconds, parameters). The decay section's fla rows."""
    return _in_workers(jobs, work, say)


def _in_workers(jobs: list[dict[str, Any]], work: Path, say: Progress) -> dict[str, dict]:
    """Plain subprocesses (``python -m edgelin.bench --export``), not multiprocessing: a caller's script is never re-imported."""
    n = min(2, os.cpu_count() or 1, len(jobs))
    groups: list[list[dict]] = [[] for _ in range(n)]
    for job in sorted(jobs, key=lambda j: -EXPORT_COST[j["kind"]]):  # longest first, onto the least-loaded worker
        min(groups, key=lambda g: sum(EXPORT_COST[j["kind"]] for j in g)).append(job)
    say(f"exporting {len(jobs)} graph job(s) ({', '.join(j['name'] for j in jobs)}) in {n} process(es); ~10 s per graph ...")
    t0 = time.perf_counter()
    procs = []
    for i, group in enumerate(groups):
        jobs_file = work / f"export-jobs-{i}.json"
        jobs_file.write_text(json.dumps(group), encoding="utf-8")
        log = open(work / f"export-jobs-{i}.log", "w+", encoding="utf-8")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        procs.append((jobs_file, log, subprocess.Popen([sys.executable, "-m", "edgelin.bench", "--export", str(jobs_file)],
                                                       stdout=log, stderr=subprocess.STDOUT, env=env)))
    results, failures = {}, []
    try:
        for jobs_file, log, proc in procs:
            code = proc.wait()
            if code == 0:
                results.update(json.loads(jobs_file.with_suffix(".result.json").read_text(encoding="utf-8")))
            else:
                log.seek(0)
                lines = [line.strip() for line in log.read().splitlines() if line.strip()]
                failures.append((lines or [f"exit status {code}"])[-1][:300])
    finally:
        for _, log, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    if failures:
        raise BenchError(f"exporting the benchmark graphs failed: {failures[0]}")
    say(f"  exports done in {time.perf_counter() - t0:.1f} s")
    return results


# ---- the check against PyTorch -------------------------------------------------------------------
Checks = dict[str, dict[str, parity.Errors]]  # graph name -> {"logits": worst errors, "state": worst errors}


def _run(path: Path, feeds: dict[str, np.ndarray], threads: int) -> dict[str, np.ndarray]:
    sess = open_session(path, "cpu", options=session_options(threads))
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def verify(paths: dict[str, Path], subject: Subject, twin: SoftmaxLM | None, threads: int, say: Progress) -> Checks:
    """Each graph exported here vs PyTorch, on CPU, with the parity budgets: logits by the "logits" budget,
    states and KV caches by the "state" budget. BenchError if any is outside; nothing is timed then."""
    say("checking the baseline graphs against PyTorch ...")
    gen = torch.Generator().manual_seed(DATA_SEED)
    V = subject.model.vocab_size
    checks: Checks = {}
    with torch.inference_mode():
        if twin is not None and ("softmax_decode" in paths or "softmax_prefill" in paths):
            ids = torch.randint(0, V, (2, 37), generator=gen)
            ref, cache = twin(ids)
            if "softmax_prefill" in paths:
                got = _run(paths["softmax_prefill"], {INPUT_IDS: ids.numpy(), LOGITS_AT: positions_feed(*ids.shape)}, threads)
                checks["softmax_prefill"] = _check(got, ref, {f"present.{k}": c for k, c in cache.items()})
            if "softmax_decode" in paths:
                worst = {"logits": parity.NONE, "state": parity.NONE}
                for past in (1, 37):  # the dynamic past length at its smallest and at another value
                    kv = {k: v[:, :, :past] for k, v in cache.items()}
                    tok = torch.randint(0, V, (2, 1), generator=gen)
                    ref2, cache2 = twin(tok, kv)
                    got = _run(paths["softmax_decode"], {INPUT_IDS: tok.numpy(), **{f"past.{k}": v.numpy() for k, v in kv.items()}}, threads)
                    worst = _worse(worst, _check(got, ref2, {f"present.{k}": c for k, c in cache2.items()}))
                checks["softmax_decode"] = worst
        if twin is not None and "softmax_gqa" in paths:
            checks["softmax_gqa"] = _check_kv_buffer(paths["softmax_gqa"], twin, gen, threads)
        model, specs = subject.model, subject.model.state_specs()
        for name in [n for n in paths if n == "parallel" or n.startswith("chunk")]:
            C = chunk_size(model) if name == "parallel" else int(name[len("chunk"):])
            worst = {"logits": parity.NONE, "state": parity.NONE}
            for T in sorted({1, C + 1, 2 * C + 3}):
                ids = torch.randint(0, V, (2, T), generator=gen)
                state = fresh_state(specs, 2)
                ref, ref_state = model(ids, state)  # the model's own prefill form: every form must give the same
                got = _run(paths[name], {INPUT_IDS: ids.numpy(), LOGITS_AT: positions_feed(*ids.shape), **to_numpy(specs, state)}, threads)
                worst = _worse(worst, _check(got, ref, {s.output: ref_state[s.key] for s in specs}))
            checks[name] = worst
    budgets = {kind: parity.budget(PRECISION, kind) for kind in ("logits", "state")}
    bad = {n: c for n, c in checks.items() if not all(parity.within(c[kind], budgets[kind]) for kind in budgets)}
    if bad:
        raise BenchError("a baseline graph disagrees with PyTorch: "
                         + ", ".join(f"{n} logits max abs {c['logits'].max_abs:.2e}, state rel L2 {c['state'].rel_l2:.2e}" for n, c in bad.items())
                         + f" (budgets {budgets}); nothing was timed")
    say("  " + ", ".join(f"{n} {c['logits'].max_abs:.1e}" for n, c in checks.items()) + f" (logits max abs, budget {budgets['logits']}): ok")
    return checks


KV_BUFFER_CHECK = ((0, 5), (37, 4))  # (tokens the twin prefills, steps): from an empty buffer, and after an odd length
KV_BUFFER_FAR = 4099  # then 2 steps after a random cache this long (or the graph's whole length, if shorter): RoPE far out


def _check_kv_buffer(path: Path, twin: SoftmaxLM, gen: torch.Generator, threads: int) -> dict[str, parity.Errors]:
    """The KV-buffer decode graph step by step against the twin's own steps (batch 2): the logits of every
    step, and the buffers' filled part against the twin's grown cache."""
    cfg, V = twin.cfg, twin.cfg.vocab_size
    sess = open_session(path, "cpu", options=session_options(threads))
    far = min(KV_BUFFER_FAR, gqa.graph_capacity(sess)) - 2
    worst = {"logits": parity.NONE, "state": parity.NONE}
    for past, steps, prefilled in [(p, s, True) for p, s in KV_BUFFER_CHECK] + [(far, 2, False)]:
        decoder = gqa.KVBufferDecoder(sess, n_layers=cfg.n_layers, n_heads=cfg.n_heads, head_dim=cfg.head_dim, batch=2, capacity=past + steps)
        cache = None
        if past:
            cache = (twin(torch.randint(0, V, (2, past), generator=gen))[1] if prefilled
                     else {k: torch.randn(2, cfg.n_heads, past, cfg.head_dim, generator=gen) for k in kv_keys(cfg.n_layers)})
            decoder.load({k: c.numpy() for k, c in cache.items()})
        for _ in range(steps):
            tok = torch.randint(0, V, (2, 1), generator=gen)
            ref, cache = twin(tok, cache)
            got = {LOGITS: decoder.step(tok.numpy()), **{f"present.{k}": c for k, c in decoder.cache().items()}}
            worst = _worse(worst, _check(got, ref, {f"present.{k}": c for k, c in cache.items()}))
    return worst


def _check(got: dict[str, np.ndarray], logits: torch.Tensor, states: dict[str, torch.Tensor]) -> dict[str, parity.Errors]:
    """Errors of a graph's outputs (by name) against PyTorch: the logits, and the worst of the named states."""
    state = parity.NONE
    for name, ref in states.items():
        state = state.worst(parity.errors(got[name], ref.numpy()) if name in got else parity.Errors(float("inf"), float("inf")))
    return {"logits": parity.errors(got[LOGITS], logits.numpy()), "state": state}


def _worse(a: dict[str, parity.Errors], b: dict[str, parity.Errors]) -> dict[str, parity.Errors]:
    return {k: a[k].worst(b[k]) for k in a}


def verification_record(checks: Checks) -> dict[str, Any]:
    """The JSON record of the check: budgets, every error, and the logits max abs error per graph."""
    return {
        "precision": PRECISION,
        "budgets": {kind: parity.budget(PRECISION, kind) for kind in ("logits", "state")},
        "max_abs_error": {n: c["logits"].max_abs for n, c in checks.items()},
        "errors": {n: {kind: vars(e) for kind, e in c.items()} for n, c in checks.items()},
    }


__all__ = ["KV_BUFFER_CHECK", "KV_BUFFER_FAR", "SoftmaxDecode", "SoftmaxPrefill", "export_one", "export_worker_main", "kv_keys", "plan_exports", "run_exports",
           "softmax_twin", "verification_record", "verify"]
