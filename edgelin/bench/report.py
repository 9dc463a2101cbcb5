"""A bench run's record and its table: ``BenchReport``, the record's envelope (``record``), the JSON file, the
output folder's check, and the printed table of every section's results.

Torch-free: the table is a function of the record alone (``format_table(json.load(...))`` prints any record of
docs/bench/), so this module reads the sections' results and never imports a section.
"""

from __future__ import annotations

import os
import time
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from edgelin.runtime.files import check_output_folder, check_replace, json_format, json_ready, write_json

from .genai_rounds import said_rounds
from .goals import goal_lines, goals
from .harness import busy, load_average
from .plots import BENCH_PLOT, PLOT_FILES, PLOT_SOFTWARE

FORMAT = "edgelin-bench/1"
JSON_FILE = "bench.json"
DEFAULT_OUT = "bench-results"


@dataclass
class BenchReport:
    data: dict[str, Any]
    json_path: Path | None = None
    plots: list[Path] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return self.data

    def table(self) -> str:
        return format_table(self.data)


_finite = json_ready  # the bench's former name for the one JSON clean-up (edgelin.runtime.files)

# What the bench writes into --out, and how an earlier run's files are recognised (by content, not name):
# bench.json by its "format" key, each plot by the PNG text chunk Software = "edgelin bench" (``plots``).
BENCH_JSON = json_format("edgelin-bench/", "an edgelin bench report (JSON with format edgelin-bench/1)")


def out_folder(out_dir: str | os.PathLike, overwrite: bool = False) -> Path:
    """The output folder, checked now (kind, writable; bench.json and the plots it will hold may be replaced)
    and created only when there is something to write (``make_parents`` in run_bench): a failed run leaves no folder."""
    out = check_output_folder(out_dir)
    check_replace(out / JSON_FILE, "bench report", overwrite=overwrite, ours=BENCH_JSON)
    for name in PLOT_FILES:
        check_replace(out / name, "plot", overwrite=overwrite, ours=BENCH_PLOT)
    return out


def record(results: dict[str, Any], *, machine: dict[str, Any], settings: dict[str, Any], quick: bool, model: dict[str, Any] | None,
           started: float, method: dict[str, Any] | None = None, exports: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """A run's record: what every bench record holds (format, time, settings, the machine and its load at the start and
    now, the model under test or None), the sections' ``results``, the seconds since ``started`` (perf_counter) and
    the goals judged on these figures."""
    machine["load_average_end"] = load_average()
    data = {"format": FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "quick": bool(quick), "settings": settings,
            "machine": machine, "busy": busy(machine), "model": model}
    if method is not None:
        data["method"] = method
    if exports is not None:
        data["exports"] = exports
    data.update({**results, "seconds": time.perf_counter() - started, **extra})
    data["goals"] = goals(data)
    return data


def write_json_atomic(data: dict, path: Path, *, overwrite: bool = False) -> Path:
    """``edgelin.runtime.files.write_json`` with the bench's argument order: atomic, non-finite -> null; an
    existing file is replaced only if it is an earlier bench report (or with ``overwrite``)."""
    return write_json(path, data, overwrite=overwrite, ours=BENCH_JSON, what="bench report")


# ---- the printed table ----------------------------------------------------------------------------
def _ms(s: dict) -> str:
    return f"{s['median']:8.3f} [{s['p10']:.3f}-{s['p90']:.3f}]"


def mb(n: float) -> str:
    if n >= 1e9:
        return f"{n / 1e9:,.2f} GB"
    return f"{n / 1e6:,.2f} MB" if n >= 1e5 else f"{n / 1e3:,.1f} kB"


def format_table(d: dict) -> str:
    m, s = d["machine"], d["settings"]
    v = m["versions"]
    lines = [
        f"edgelin bench{' --quick (smoke run: sizes too small to mean anything)' if d['quick'] else ''}",
        f"machine: {m['cpu_model']}, {m['usable_cores']} usable core(s) of {m['cores']}, caches {', '.join(f'{k} {x}' for k, x in m['caches'].items()) or 'n/a'}, "
        f"memory {(m['memory_total_bytes'] or 0) / 2**30:.1f} GiB",
        f"software: onnxruntime {v['onnxruntime']}, torch {v['torch']}, numpy {v['numpy']}, onnx {v['onnx']}, python {v['python']}",
        f"settings: threads {s['threads']} (torch and ORT intra-op), provider {s['provider_requested']} -> active {s['provider_active'] or '-'}",
        f"model: {d['model']['label']}; {d['model']['parameters']:,} parameters; state {d['model']['state_bytes_per_sequence']:,} bytes per sequence"
        if d.get("model") else "model: none under test (only opt-in sections ran; each describes its own model)",
        f"load average at start {d['busy']['load_1min_start']:.2f} on {d['busy']['cores']} core(s)"
        + (": BUSY machine, numbers are not representative" if d["busy"]["busy"] else ""),
        "figures: median [p10-p90] over repeated calls after warm-up; decode contenders interleaved in one process, "
        "prefill forms run back to back per length, all in this one bench run",
    ]
    if d.get("goals"):
        lines += ["", *goal_lines(d["goals"])]
    if "decode" in d:
        lines += ["", "1. decode latency per call (ms), median [p10-p90]"]
        for B, row in d["decode"]["batches"].items():
            for name in ("torch_eager", "ort_run", "ort_iobinding"):
                lines.append(f"  batch {B:>2}  {name:14s} {_ms(row[name])}  {row[name]['tokens_per_s']:>10,.0f} tok/s")
            r = row["ratios"]
            lines.append(f"            eager / ORT run {r['torch_eager_over_ort_run']:.2f}x, eager / ORT binding {r['torch_eager_over_ort_iobinding']:.2f}x, "
                         f"run / binding {r['ort_run_over_ort_iobinding']:.2f}x")
    if "throughput" in d:
        t = d["throughput"]
        lines += ["", f"1b. decode throughput vs batch (ORT IO binding; batches interleaved; best batch {t['best_batch']})",
                  f"  {'batch':>5}  {'ms per step':>26}  {'ms/token':>9}  {'tokens/s':>12}  {'x batch 1':>9}"]
        for B, r in t["batches"].items():
            over = r.get("tokens_per_s_over_batch_1")
            lines.append(f"  {B:>5}  {_ms(r['ms_per_step']):>26}  {r['ms_per_token']:9.4f}  {r['tokens_per_s']:>12,.0f}  "
                         + (f"{over:8.2f}x" if over else f"{'-':>9}"))
    if "position" in d:
        lines += ["", *position_lines(d["position"])]
    if "prefill" in d:
        p = d["prefill"]
        lines += ["", f"3. prefill, batch 1: tokens/s and peak memory increment (memory cap {mb(p['memory_cap_bytes'])}, time cap {p['time_cap_s']:.0f} s per run)"]
        for r in p["rows"]:
            name = r["form"] + (f"/{r['piece']}" if r.get("piece") else "")
            if r["status"] == "ok":
                lines.append(f"  {name:18s} T={r['T']:>6,}  {r['tokens_per_s']:>12,.0f} tok/s  [{r['T'] / r['seconds']['p90']:,.0f}-{r['T'] / r['seconds']['p10']:,.0f}]  "
                             f"n={r['seconds']['n']:<2}  peak +{mb(r['peak_increment_bytes'])} (RSS {mb(r['peak_rss_bytes'])})")
            else:
                lines.append(f"  {name:18s} T={r['T']:>6,}  {r['status']}: {r['reason']}")
        for form, why in (p.get("forms_not_run") or {}).items():
            lines.append(f"  {form:18s} not run: {why}")
        for r in p["ratios"]:
            parts = [f"{k} {x:.2f}x" for k, x in r.items() if k != "T"]
            if parts:
                lines.append(f"  T={r['T']:>6,}: " + ", ".join(parts))
    if "sweep" in d:
        w = d["sweep"]
        lines += ["", f"3b. chunk size sweep, prefill T={w['length']:,} (model's chunk {w['model_chunk']}, best {w['best_chunk']})"]
        if w.get("note"):
            lines.append(f"  note: {w['note']}")
        for r in w["rows"]:
            if r["status"] == "ok":
                lines.append(f"  chunk {r['chunk']:>4}  {r['tokens_per_s']:>12,.0f} tok/s  ({r['over_best']:.2f} of best)  peak +{mb(r['peak_increment_bytes'])}")
            else:
                lines.append(f"  chunk {r['chunk']:>4}  {r['status']}: {r['reason']}")
    if "floor" in d:
        f = d["floor"]
        bw = f["bandwidth_GBps"]
        lines += ["", f"4. floor: copy bandwidth {bw['median']:.1f} GB/s median, {bw['max']:.1f} best; decode weights {mb(f['weight_bytes'])}, "
                      f"state {mb(f['state_bytes_per_sequence'])} per sequence"]
        for B, r in f["batches"].items():
            lines.append(f"  batch {B:>2}: floor {r['floor_ms_per_token']:.4f} ms/token (weights alone {r['weights_only_floor_ms_per_token']:.4f}), "
                         f"measured {r['measured_ms_per_token']:.4f} ms/token "
                         f"-> measured / floor {r['measured_over_floor']:.1f}x")
        if f["weights_fit_in_cache"]:
            lines.append(f"  note: weights + state fit in the last-level cache ({mb(f['last_level_cache_bytes'])}): the DRAM floor is not binding")
    if "fla" in d:
        lines += ["", *fla_lines(d["fla"])]
    if "decay" in d:
        lines += ["", *decay_lines(d["decay"])]
    if "precision" in d:
        lines += ["", *precision_lines(d["precision"])]
    if "llamacpp" in d:
        lines += ["", *llamacpp_lines(d["llamacpp"])]
    if "lowering" in d:
        lines += ["", *lowering_lines(d["lowering"])]
    if "hybrid" in d:
        lines += ["", *hybrid_lines(d["hybrid"])]
    if "transformers" in d:
        lines += ["", *transformers_lines(d["transformers"])]
    if "genai" in d:
        lines += ["", *genai_lines(d["genai"])]
    plots = d.get("plots") or {}
    lines += ["", f"plots: {', '.join(plots.get('files') or []) or 'skipped (' + str(plots.get('skipped')) + ')'}",
              f"total {d['seconds']:.1f} s"]
    return "\n".join(lines)


def not_run_lines(head: str, x: dict) -> list[str]:
    """An opt-in section that did not run (skipped or failed): its heading and why."""
    return [head, f"  {x.get('status', 'skipped')}: {x.get('reason', '')}"]


def opt_in_table(head: str) -> Callable[[Callable[[dict], list[str]]], Callable[[dict], list[str]]]:
    """An opt-in section's table: ``head``, then the rows the decorated function makes of the section's record, or
    ``head`` and why the section did not run."""
    def wrap(rows: Callable[[dict], list[str]]) -> Callable[[dict], list[str]]:
        @functools.wraps(rows)
        def lines(x: dict) -> list[str]:
            return [head, *rows(x)] if x.get("status") == "ok" else not_run_lines(head, x)
        return lines
    return wrap


def position_lines(x: dict) -> list[str]:
    """The position section's rows of the table: linear vs both softmax baselines, the strongest named per P."""
    lines = ["2. decode at position P (ms per step) and memory per sequence; x = baseline / linear (above 1: linear is faster)",
             f"  {'P':>7}  {'linear':>26}  {'softmax, KV concat':>26}  {'x':>7}  {'softmax, GQA in place':>26}  {'x':>7}  "
             f"{'strongest':>9}  {'x':>7}  {'state':>10}  {'KV cache':>10}"]

    def cell(r: dict, name: str, ms: str, over: str) -> str:
        return f"{_ms(r[ms]):>26}  {r[over]:6.2f}x" if ms in r else f"{'skipped' if name in r.get('skipped', {}) else '-':>26}  {'-':>7}"

    for r in x["rows"]:
        strongest = (f"{r['strongest_baseline'].removeprefix('softmax_'):>9}  {r['strongest_over_linear']:6.2f}x" if "strongest_baseline" in r
                     else f"{'-':>9}  {'-':>7}")
        lines.append(f"  {r['position']:>7,}  {_ms(r['linear_ms']):>26}  {cell(r, 'softmax_kv', 'softmax_kv_ms', 'softmax_over_linear')}  "
                     f"{cell(r, 'softmax_gqa', 'softmax_gqa_ms', 'softmax_gqa_over_linear')}  {strongest}  {mb(r['linear_state_bytes']):>10}  "
                     + (f"{mb(r['kv_cache_bytes']):>10}" if "kv_cache_bytes" in r else f"{'-':>10}"))
        for name, why in (r.get("skipped") or {}).items():
            lines.append(f"           {name} skipped at P={r['position']:,}: {why}")
    for key in ("softmax_baseline", "softmax_gqa_baseline"):
        if x.get(key, "").startswith("skipped"):
            lines.append(f"  softmax twin {x[key]}")
            break
    else:
        lines.append("  kv = softmax twin, KV cache concatenated per step (torch.onnx); gqa = ORT GroupQueryAttention, preallocated KV buffer updated in place")
    return lines


@opt_in_table("5. fla: a flash-linear-attention checkpoint imported + exported, decode vs fla's own step")
def fla_lines(f: dict) -> list[str]:
    """The fla section's rows of the table."""
    cfg, ie, dec = f["fla_config"], f["import_export"], f["decode"]
    first, later = ie["first"], ie["median_after_first"]
    lines = [f"  model: fla linear_attn, hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, {cfg['num_heads']} heads, "
             f"vocab {cfg['vocab_size']}, feature map {cfg['feature_map']}; {f['parameters']:,} parameters; "
             f"decode graph {f['decode_nodes']} nodes; fla {f['versions']['fla']}, triton {f['versions']['triton']}",
             f"  import + export: first {first['import_s']:.2f} s + {first['export_s']:.1f} s = {first['total_s']:.1f} s (torch.onnx warm-up included)"
             + (f"; later runs (median of {len(ie['runs']) - 1}) {later['import_s']:.2f} s + {later['export_s']:.1f} s = {later['total_s']:.1f} s"
                if len(ie["runs"]) > 1 else ""),
             "  decode, batch 1 (ms per token), interleaved:"]
    for name, what in (("ort_iobinding", "ONNX decode graph, runtime Session, IO binding"),
                       ("torch_eager", "imported model, PyTorch eager step"),
                       ("fla_step", "fla's own cached step (Triton interpreter on CPU)")):
        lines.append(f"    {name:14s} {_ms(dec[name])}  {dec[name]['tokens_per_s']:>8,.1f} tok/s  {what}")
    r = dec["ratios"]
    lines.append(f"    fla / ORT {r['fla_step_over_ort_iobinding']:,.0f}x, fla / eager {r['fla_step_over_torch_eager']:,.0f}x, "
                 f"eager / ORT {r['torch_eager_over_ort_iobinding']:.2f}x; checked first: "
                 + ", ".join(f"{k} {e['max_abs']:.1e}" for k, e in f["check"]["errors"].items()) + " (logits max abs)")
    return lines


@opt_in_table("6. decay: LinearLM with each decay vs the plain one (same size, random weights)")
def decay_lines(x: dict) -> list[str]:
    """The decay section's rows of the table."""
    c = x["config"]
    lines = [f"  d_model {c['d_model']}, {c['n_layers']} layers, {c['n_heads']} heads x {c['head_dim']}, {c['feature_map']}, conv {c['conv_size']}; "
             "decode batch 1 ORT IO binding (interleaved); prefill tokens/s (x = over decay none), peak memory increment",
             f"  {'decay':12s} {'decode ms/token':>24s} {'x':>6s}  " + "  ".join(f"{'T=' + format(T, ','):>29s}" for T in x["lengths"])
             + f"  {'nodes decode/prefill':>21s}  {'params':>9s}  {'last/first T':>12s}  {'in pieces':>9s}"]
    ok = {(r["decay"], r["T"]): r for r in x["prefill"] if r["status"] == "ok" and not r.get("piece")}
    for d, m in x["models"].items():
        cells = []
        for T in x["lengths"]:
            r = ok.get((d, T))
            rel = m.get("prefill_tokens_per_s_over_none", {}).get(str(T))
            cells.append(f"{r['tokens_per_s']:>9,.0f} {'(' + format(rel, '.2f') + 'x)' if rel else '':>8s} {mb(r['peak_increment_bytes']):>10s}"
                         if r else f"{'failed':>29s}")
        rel = f"{m['decode_over_none']:.2f}x" if "decode_over_none" in m else "-"
        nodes = f"{m['nodes'].get('decode')}/{m['nodes'].get('prefill')}"
        scaling = f"{m['scaling']['tokens_per_s_ratio']:.2f}x" if "scaling" in m else "-"
        pieces = f"{m['scaling']['pieces_tokens_per_s_ratio']:.2f}x" if "pieces_tokens_per_s_ratio" in m.get("scaling", {}) else "-"
        lines.append(f"  {d:12s} {_ms(m['decode_ms']):>24s} {rel:>6s}  " + "  ".join(cells)
                     + f"  {nodes:>21s}  {m['parameters']:>9,}  {scaling:>12s}  {pieces:>9s}")
    piece = next((r["piece"] for r in x["prefill"] if r.get("piece")), None)
    if piece:
        lines.append(f"  last/first T: tokens/s of one call at each; in pieces: the last length in calls of {piece:,} tokens "
                     "(the runtime's default), over one call of the first")
    for r in x["prefill"]:
        if r["status"] != "ok":
            at = f"T={r['T']:,}" + (f" in pieces of {r['piece']:,}" if r.get("piece") else "")
            lines.append(f"  prefill {r['decay']} {at}: {r['status']}: {r.get('reason', '')}")
    return lines + fla_decay_lines(x.get("fla"))


def fla_decay_lines(f: dict | None) -> list[str]:
    """The decay section's fla rows: fla's recurrences against its Gated DeltaNet (decay.fla_section)."""
    if not f:
        return []
    if f["status"] != "ok":
        return ["", f"  fla's recurrences: {f['status']}: {f['reason']}"]
    runs = [(T, None) for T in f["lengths"]] + [(T, f["piece"]) for T in f["lengths"] if T > f["piece"]]
    key = lambda T, piece: f"{T}" + (f"/{piece}" if piece else "")  # noqa: E731
    lines = ["", f"  fla's recurrences vs {f['baseline']} (fla's configs, random init; imported, exported portable, max_sequence "
             f"{f['max_sequence']:,}); prefill tokens/s (x = over {f['baseline']}), T/{f['piece']:,} = in calls of {f['piece']:,}",
             f"  {'model':18s} {'decode ms/token':>24s} {'x':>6s}  " + "  ".join(f"{'T=' + key(T, p):>18s}" for T, p in runs)
             + f"  {'nodes decode/prefill':>21s}  {'params':>9s}"]
    for n, m in f["models"].items():
        cells = []
        for T, piece in runs:
            tps = (m["prefill_pieces_tokens_per_s"] if piece else m["prefill_tokens_per_s"]).get(str(T))
            rel = m.get("prefill_tokens_per_s_over_baseline", {}).get(key(T, piece))
            cells.append(f"{tps:>9,.0f} {'(' + format(rel, '.2f') + 'x)' if rel else '':>8s}" if tps else f"{'failed':>18s}")
        rel = f"{m['decode_over_baseline']:.2f}x" if "decode_over_baseline" in m else "-"
        lines.append(f"  {n:18s} {_ms(m['decode_ms']):>24s} {rel:>6s}  " + "  ".join(cells)
                     + f"  {str(m['nodes'].get('decode')) + '/' + str(m['nodes'].get('prefill')):>21s}  {m['parameters']:>9,}")
    for r in f["prefill"]:
        if r["status"] != "ok":
            lines.append(f"  prefill {r['model']} T={r['T']:,}" + (f" in pieces of {r['piece']:,}" if r.get("piece") else "")
                         + f": {r['status']}: {r.get('reason', '')}")
    return lines


@opt_in_table("7. precision: the model in fp32 / fp16 / int8 / int4 (exported and checked here)")
def precision_lines(x: dict) -> list[str]:
    """The precision section's rows of the table."""
    lines = [f"  {x['model']}; decode ORT IO binding, precisions interleaved (x = over fp32); floor = decode weight bytes / "
             f"{x['bandwidth_GBps']['max']:.1f} GB/s copy bandwidth",
             f"  {'prec':5s} {'on disk':>9s} {'weights':>9s} {'provider':>8s}  " + "  ".join(f"{'decode B=' + str(B) + ' ms/token':>31s}" for B in x["batches"])
             + "  " + "  ".join(f"{'prefill T=' + format(T, ',') + ' tok/s, peak':>29s}" for T in x["lengths"]) + f"  {'floor B=1 ms, measured/floor':>30s}"]
    ok = {(r["precision"], r["T"]): r for r in x["prefill"] if r["status"] == "ok"}
    for n, m in x["models"].items():
        dec = []
        for B in x["batches"]:
            ms = m["decode_ms"][str(B)]["median"] / B
            rel = m.get("decode_over_fp32", {}).get(str(B))
            dec.append(f"{ms:>21.4f} {'(' + format(rel, '.2f') + 'x)' if rel else '':>9s}")
        pre = []
        for T in x["lengths"]:
            r = ok.get((n, T))
            pre.append(f"{r['tokens_per_s']:>17,.0f} {mb(r['peak_increment_bytes']):>11s}" if r else f"{'failed':>29s}")
        f = m["floor"]["1"]
        lines.append(f"  {n:5s} {mb(sum(m['bytes_on_disk'].values())):>9s} {mb(m['decode_weight_bytes']):>9s} {m['provider_active']:>8s}  "
                     + "  ".join(dec) + "  " + "  ".join(pre) + f"  {f['floor_ms_per_token']:>14.4f} {f['measured_over_floor']:>14.1f}x")
    for r in x["prefill"]:
        if r["status"] != "ok":
            lines.append(f"  prefill {r['precision']} T={r['T']:,}: {r['status']}: {r.get('reason', '')}")
    return lines


@opt_in_table("8. llamacpp: edgelin vs llama.cpp on the same transformers checkpoints (tokens/s, medians over alternating rounds)")
def llamacpp_lines(x: dict) -> list[str]:
    """The llamacpp section's rows of the table."""
    v = x["versions"]
    lines = [f"  llama.cpp from llama-cpp-python {v.get('llama_cpp_python_sdist')} (build {v.get('build_commit')}), onnxruntime "
             f"{v.get('onnxruntime')}; x = edgelin / llama.cpp (above 1: edgelin faster)",
             f"  {'model':7s} {'prec':5s} {'gguf':5s} {'thr':>3s} {'runtime':7s}  "
             + "  ".join(f"{t + ' llama.cpp / edgelin':>28s} {'x':>6s}" for t in x["tests"])]
    for r in x["rows"]:
        cells = [f"{r[t]['llama_cpp_tokens_per_s']:>13,.0f} / {r[t]['edgelin_tokens_per_s']:>12,.0f} {r[t]['edgelin_over_llama_cpp']:>5.2f}x"
                 if t in r else f"{'not measured':>28s} {'':>6s}" for t in x["tests"]]
        lines.append(f"  {r['model']:7s} {r['precision']:5s} {r['gguf']:5s} {r['threads']:>3d} {r.get('runtime', 'python'):7s}  " + "  ".join(cells))
        for t, why in (r.get("not_measured") or {}).items():
            lines.append(f"    {r.get('runtime', 'python')} {t}: {why}")
    for r in x.get("runtimes_not_run", []):
        lines.append(f"  {r['model']:7s} {r['precision']:5s} {'':5s} {r['threads']:>3d} {r['runtime']:7s}  {r['status']}: {r['reason']}")
    lines.append("  greedy ids vs transformers': same before the first difference / top-1 same per step with transformers' ids fed")
    for name, g in x["greedy"].items():
        for side in ("edgelin", "llama.cpp"):
            cells = [f"{p} {e['agreement']:.2f} / {e['forced_top1']:.2f}" if e["status"] == "ok" else f"{p} {e['status']}" for p, e in g[side].items()]
            lines.append(f"  greedy ids vs transformers, {name}, {side}: " + ", ".join(cells))
    return lines


@opt_in_table("9. lowering: fused / portable speed (above 1: fused faster), medians of interleaved rounds")
def lowering_lines(x: dict) -> list[str]:
    """The section's rows of the bench table."""
    lines = []
    for name, row in x["models"].items():
        n = row["nodes_per_layer"]
        lines.append(f"  {name}: decode nodes per layer as run, portable {n['portable']:.2f}, fused {n['fused']:.2f}")
        for runtime, medians in row["runtimes"].items():
            if "status" in medians:
                lines.append(f"    {runtime:7s} {medians['status']}: {medians['reason']}")
                continue
            cells = ", ".join(f"{metric} x{value:.2f}" for metric, value in row["fused_speedup"][runtime].items())
            lines.append(f"    {runtime:7s} {cells}")
    return lines


@opt_in_table("10. hybrid: linear, hybrid and softmax stacks of one size (random weights), decode against context")
def hybrid_lines(x: dict) -> list[str]:
    """The hybrid section's rows of the table."""
    c = x["config"]
    layers = ", ".join(f"{s} {v['attn_layers'] or 'none'}" for s, v in x["stacks"].items())
    lines = [f"  d_model {c['d_model']}, {c['n_layers']} layers, {c['n_heads']} heads x {c['head_dim']}, {c['feature_map']}, conv "
             f"{c['conv_size']}, decay {c['decay']}; softmax attention at layers: {layers}; batch 1, interleaved",
             f"  {'position':>9s}  " + "  ".join(f"{s + ' ms/token, state MB':>30s}" for s in x["stacks"])]
    by = {(r["stack"], r["position"]): r for r in x["rows"]}
    for p in x["positions"]:
        cells = []
        for s in x["stacks"]:
            r = by[(s, p)]
            cells.append(f"{r['decode_ms']['median']:>12.3f} ms ({r['decode_over_linear']:>5.2f}x) {r['state_bytes'] / 1e6:>8.2f} MB")
        lines.append(f"  {p:>9,}  " + "  ".join(f"{c:>30s}" for c in cells))
    return lines


@opt_in_table("11. transformers: each family's export vs transformers' eager model on CPU (medians over alternating rounds)")
def transformers_lines(x: dict) -> list[str]:
    """The transformers section's rows of the table."""
    lengths = x["lengths"]
    lines = [f"  batch 1, decode {x['decode_tokens']} tokens from an empty state; prefill one call of {', '.join(map(str, lengths))} "
             f"tokens; {x['rounds']} rounds",
             f"  {'model':18s} {'decode ms/token hf / edgelin':>30s} {'x':>6s}  " + "  ".join(
                 f"{'prefill ' + str(L) + ' tok/s hf / edgelin':>34s} {'x':>6s}" for L in lengths) + "  greedy ids equal"]
    for r in x["rows"]:
        d = r["decode_ms"]
        cells = [f"{d['transformers']:>13.3f} / {d['edgelin']:>8.3f} ms {r['decode_transformers_over_edgelin']:>6.1f}"]
        for L in lengths:
            p = r["prefill_tokens_per_s"][str(L)]
            cells.append(f"{p['transformers']:>15,.0f} / {p['edgelin']:>12,.0f} {r['prefill_edgelin_over_transformers'][str(L)]:>6.1f}")
        g = x["greedy"][r["model"]]
        lines.append(f"  {r['model']:18s} " + "  ".join(cells) + f"  {'yes' if g['equal'] else 'NO'}")
    return lines

@opt_in_table("12. genai: edgelin vs onnxruntime-genai on the same checkpoint (medians over alternating rounds, each in its own process)")
def genai_lines(x: dict) -> list[str]:
    """The genai section's rows of the table."""
    v = x["versions"]
    lines = [f"  onnxruntime-genai {v.get('onnxruntime_genai')} (its onnxruntime {v.get('onnxruntime')}), edgelin on onnxruntime "
             f"{v.get('edgelin_onnxruntime')}; batch 1; prefill = one {x['prompt_tokens']}-token call; decode = median step of "
             f"{x['decode_steps']} greedy steps after it; x = edgelin / genai (above 1: edgelin faster); weights = the bytes of the "
             "export's .onnx/.data files; nodes = decode nodes per layer as ONNX Runtime runs the graph; greedy = steps equal to "
             "genai's greedy ids before the first difference"]
    for name, m in x["models"].items():
        lines.append(f"  {name}: {m['layers']} layers, vocabulary {m['vocab_size']:,}; checkpoint {m['checkpoint']}"
                     + (" (built here, random weights)" if m.get("built_here") else ""))
        lines.append(f"    {'precision':46s} {'thr':>3s}  {'contender':18s} {'weights MB':>10s} {'nodes':>6s} {'decode tok/s':>12s} "
                     f"{'x':>6s} {'prefill tok/s':>13s} {'x':>6s}  greedy")
        for r in m["rows"]:
            g = (m.get("greedy", {}).get(r["contender"]) or {}).get(r["precision"]) or {}
            nodes = r.get("decode_nodes_per_layer")
            lines.append(
                f"    {x.get('precision_names', {}).get(r['precision'], r['precision']):46s} {r['threads']:>3d}  {r['contender']:18s} "
                f"{(r['weight_bytes'] or 0) / 1e6:>10,.1f} {nodes if nodes is None else round(nodes, 1)!s:>6s} "
                f"{r['decode_tokens_per_s']:>12.2f} {_x(r.get('decode_over_genai')):>6s} {r['prefill_tokens_per_s']:>13.1f} "
                f"{_x(r.get('prefill_over_genai')):>6s}  "
                + (f"{g['same_as_genai_before']}/{len(g['ids'])}" if "same_as_genai_before" in g else "")
                + (f"  [{r['llama_cpp_path'].get('ran')}{': ' + r['llama_cpp_path']['why'] if r['llama_cpp_path'].get('why') else ''}]"
                   if r.get("llama_cpp_path") else ""))
            if r.get("rounds", 1) > 1:
                lines.append(f"    {'':46s} {'':>3s}  {'':18s} its {r['rounds']} rounds' decode: fastest/slowest {1 + r.get('decode_spread', 0):.2f}"
                             + (f"; vs genai {said_rounds(r['decode_over_genai_rounds'])}" if r.get("decode_over_genai_rounds") else ""))
        for e, info in m.get("exports", {}).items():
            if info.get("check") not in (None, "passed"):
                lines.append(f"    {e}: export check {info['check']}")
        if m.get("llama_cpp_failed"):
            lines.append(f"    llama.cpp: {m['llama_cpp_failed']}")
        for p, prof in (m.get("profiles") or {}).items():
            if prof.get("contenders"):
                from .ortprofile import compare_lines

                lines.append(f"    ONNX Runtime's profile, {x.get('precision_names', {}).get(p, p)} at {prof['threads']} thread(s), one "
                             "run of each after the rounds: kernel µs by operator type in the median decode step (nodes per step):")
                lines += ["      " + line for line in compare_lines(prof["contenders"])]
        for f in m.get("failed", []):
            run = f"round {f['round'] + 1}" if isinstance(f["round"], int) else f["round"]
            at = f" {f['threads']} thread(s)" if "threads" in f else ""
            lines.append(f"    failed: {f['precision']}{at} {f['contender']} {run}: {f['reason']}")
    ll = x.get("llama_cpp") or {}
    if ll.get("status") != "ok":
        lines.append(f"  llama.cpp: {ll.get('status', 'skipped')}: {ll.get('reason', '')}")
    load = x.get("load_average") or {}
    lines.append(f"  load average (1, 5, 15 min) at the start {load.get('start')}, at the end {load.get('end')}")
    return lines


def _x(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


__all__ = ["BENCH_JSON", "BENCH_PLOT", "DEFAULT_OUT", "FORMAT", "JSON_FILE", "PLOT_FILES", "PLOT_SOFTWARE", "BenchReport", "decay_lines", "fla_lines",
           "format_table", "genai_lines", "hybrid_lines", "llamacpp_lines", "lowering_lines", "mb", "not_run_lines", "out_folder", "position_lines",
           "precision_lines", "record", "transformers_lines", "write_json_atomic"]
