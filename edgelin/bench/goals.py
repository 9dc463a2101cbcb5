"""The project's decode and prefill speed goals next to one bench run's figures.

Read from a finished bench record (the sections' JSON), never measured here, so the goals and the
figures they are judged on come from the same run. Batch 1, the bench's thread count:

    eager_over_ort     PyTorch eager ``step`` ms / ORT decode ms (IO binding), interleaved      >= 4
    nodes_per_layer    decode graph nodes per layer, as ONNX Runtime runs it (after its
                       load-time fusions; the exported count is reported beside it)             <= 28
    over_floor         decode ms per token / the floor: (weight bytes + the state read and
                       written) / copy bandwidth (the floor section)                            <= 1.3
    long_prefill       prefill tokens/s of the longest prompt in the plan's pieces (a full run: the
                       runtime's default, 1,024) / tokens/s of one call of one piece            >= 0.9
    vs_softmax         the strongest softmax baseline's decode ms / linear decode ms at the
                       longest position measured (reported, no target)
    batch_throughput   the best decode tokens/s over the batch curve / batch 1 (reported)
    vs_llamacpp_decode edgelin decode tokens/s / llama.cpp's (llama-bench tg) on the same checkpoint at the
                       same precision, the worst row at the bench's thread count (the llamacpp section)     >= 1
    vs_llamacpp_prefill  the same for prefill of 4,096 tokens (pp4096; the longest length measured)          >= 1

A goal whose section did not run is left out; ``met`` is None for the reported figures.
"""

from __future__ import annotations

from typing import Any

NODES_PER_LAYER = 28


def _goal(name: str, what: str, measured: float, target: float | None = None, at_least: bool = True, **extra: Any) -> dict[str, Any]:
    met = None if target is None else (measured >= target if at_least else measured <= target)
    return {"goal": name, "what": what, "measured": measured, "target": target,
            "direction": None if target is None else (">=" if at_least else "<="), "met": met, **extra}


def goals(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One entry per goal whose section ran: {goal, what, measured, target, direction, met, ...}."""
    out = []
    decode = data.get("decode")
    if decode and "1" in decode["batches"]:
        out.append(_goal("eager_over_ort", "PyTorch eager step / ORT decode (IO binding), batch 1",
                         decode["batches"]["1"]["ratios"]["torch_eager_over_ort_iobinding"], 4.0))
        layers = ((data.get("model") or {}).get("config") or {}).get("n_layers")
        nodes = decode.get("graph_nodes", {}).get("decode")
        if nodes and layers:
            out.append(_goal("nodes_per_layer", f"decode graph nodes per layer as ONNX Runtime runs it ({nodes['as_run']} in all; "
                             f"{nodes['exported']} exported, {nodes['exported'] / layers:.1f} per layer)",
                             nodes["as_run"] / layers, NODES_PER_LAYER, at_least=False))
    floor = data.get("floor")
    if floor and "1" in floor["batches"]:
        out.append(_goal("over_floor", "decode ms per token / the floor (weight bytes + state read and written, at copy bandwidth), batch 1",
                         floor["batches"]["1"]["measured_over_floor"], 1.3, at_least=False))
    prefill = data.get("prefill")
    long = [r for r in (prefill or {}).get("ratios", []) if "pieces_over_one_piece" in r]
    if long:
        r = long[-1]
        piece = prefill.get("piece")
        pieces = f"{piece:,}-token pieces" if piece else "pieces"
        out.append(_goal("long_prefill", f"prefill tokens/s at T = {r['T']:,} in {pieces} / one call of one piece",
                         r["pieces_over_one_piece"], 0.9))
    position = data.get("position")
    rows = [r for r in (position or {}).get("rows", []) if "strongest_baseline" in r]
    if rows:
        r = rows[-1]
        out.append(_goal("vs_softmax", f"strongest softmax baseline ({r['strongest_baseline']}) ms / linear ms at position {r['position']:,}",
                         r["strongest_over_linear"]))
    throughput = data.get("throughput")
    if throughput and throughput["batches"].get("1"):
        best = throughput["best_batch"]
        out.append(_goal("batch_throughput", f"best decode tokens/s (batch {best}) / batch 1",
                         throughput["batches"][str(best)]["tokens_per_s_over_batch_1"]))
    out += _llamacpp_goals(data)
    return out


NATIVE = ("python", "node")  # edgelin's runtimes on ONNX Runtime's native CPU kernels, what llama.cpp is judged against


def _llamacpp_goals(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Against llama.cpp, at least level: the worst row (model x precision x native runtime) at the bench's thread
    count. WASM rows are reported, not judged: a browser's engine against a native one."""
    part = data.get("llamacpp") or {}
    threads = (data.get("settings") or {}).get("threads")
    rows = [r for r in part.get("rows", []) if r.get("threads") == threads and r.get("runtime", "python") in NATIVE] if part.get("status") == "ok" else []
    if not rows:
        return []
    out = []
    prefill = [t for t in part["tests"] if t.startswith("pp")]
    for name, test, what in (("vs_llamacpp_decode", next(t for t in part["tests"] if t.startswith("tg")), "decode"),
                             ("vs_llamacpp_prefill", prefill[-1] if prefill else None, "prefill")):
        measured = [r for r in rows if test in r]  # a row may lack a test its runtime could not measure ("not_measured")
        if test is None or not measured:
            continue
        worst = min(measured, key=lambda r: r[test]["edgelin_over_llama_cpp"])
        best = max(measured, key=lambda r: r[test]["edgelin_over_llama_cpp"])
        out.append(_goal(name, f"edgelin / llama.cpp {what} tokens/s ({test}), same checkpoint and precision, {threads} thread(s): "
                               f"worst {worst['model']} {worst['precision']}/{worst['gguf']} ({worst.get('runtime', 'python')}); best "
                               f"{best['model']} {best['precision']} ({best.get('runtime', 'python')}) {best[test]['edgelin_over_llama_cpp']:.2f}"
                               + (f"; {len(rows) - len(measured)} row(s) not measured" if len(measured) < len(rows) else ""),
                         worst[test]["edgelin_over_llama_cpp"], 1.0))
    return out


def goal_lines(entries: list[dict[str, Any]]) -> list[str]:
    """The report's goals block: target, measured, met."""
    lines = ["0. goals (batch 1 unless stated; every figure from this run)"]
    for g in entries:
        target = f"{g['direction']} {g['target']:g}" if g["target"] is not None else "reported"
        verdict = {True: "met", False: "NOT met", None: ""}[g["met"]]
        lines.append(f"  {g['goal']:17s} {g['measured']:8.2f}  {target:>9}  {verdict:7s}  {g['what']}")
    return lines


__all__ = ["NODES_PER_LAYER", "goal_lines", "goals"]
