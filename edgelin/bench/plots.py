"""The bench's PNG plots: one per default section in a record, written atomically into the output folder.

matplotlib is optional (the ``plots`` extra): without it the plots are skipped and the record says so. An earlier
run's plot is recognised by its PNG text chunk Software = "edgelin bench", so that ``--out`` replaces only those.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import numpy as np

from edgelin.runtime.files import atomic_write, png_text

PLOT_FILES = ("decode.png", "throughput.png", "position.png", "prefill.png", "sweep.png", "floor.png")
PLOT_SOFTWARE = "edgelin bench"
BENCH_PLOT = png_text("Software", PLOT_SOFTWARE, "a plot edgelin bench drew (PNG with Software = edgelin bench)")


def write_plots(data: dict, out: Path, *, overwrite: bool = False) -> tuple[list[Path], dict[str, Any]]:
    """One PNG per section in ``data`` (atomically), and the report's "plots" entry."""
    try:  # an optional extra, imported only to plot: importing the bench must not pick a matplotlib backend
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return [], {"files": [], "skipped": "matplotlib is not installed (pip install 'edgelin[plots]')"}
    files = []
    label = data["model"]["label"] if data.get("model") else "opt-in sections only: " + ", ".join(data["settings"]["sections"])
    title = "\n".join(textwrap.wrap(label, 110)[:2])
    title += f"\n{data['machine']['cpu_model']}, threads {data['settings']['threads']}, {data['settings']['provider_active']}"
    if data.get("quick") or data["busy"]["busy"]:
        title += "  [" + ", ".join(x for x in ("QUICK" if data.get("quick") else "", "BUSY MACHINE" if data["busy"]["busy"] else "") if x) + "]"

    def save(fig, name):
        fig.suptitle(title, fontsize=8)
        fig.tight_layout()
        try:
            assert name in PLOT_FILES, name  # run_bench checks these names before any work
            files.append(atomic_write(out / name, lambda f: fig.savefig(f, format="png", dpi=120, metadata={"Software": PLOT_SOFTWARE}),
                                      overwrite=overwrite, ours=BENCH_PLOT, what="plot"))
        finally:
            plt.close(fig)

    def err(s):  # asymmetric error bars p10..p90 around the median
        return [[s["median"] - s["p10"]], [s["p90"] - s["median"]]]

    def log_ticks(ax, values):  # label the measured lengths themselves: 128, 1k, 16k, 64k
        ax.set_xticks(values, [f"{v // 1024}k" if v >= 1024 and v % 1024 == 0 else str(v) for v in values])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())

    if "decode" in data:
        fig, ax = plt.subplots(figsize=(7, 4))
        batches = list(data["decode"]["batches"])
        names = ["torch_eager", "ort_run", "ort_iobinding"]
        width = 0.8 / len(names)
        for j, name in enumerate(names):
            for i, B in enumerate(batches):
                s = data["decode"]["batches"][B][name]
                ax.bar(i + j * width, s["median"] / int(B), width, yerr=np.array(err(s)) / int(B), capsize=3,
                       color=f"C{j}", label=name if i == 0 else None)
        ax.set_xticks([i + width for i in range(len(batches))], [f"batch {B}" for B in batches])
        ax.set_ylabel("ms per token (median, p10-p90)")
        ax.set_title("decode latency per token")
        ax.legend()
        save(fig, "decode.png")
    if "throughput" in data:
        rows = data["throughput"]["batches"]
        B = [int(b) for b in rows]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        a1.plot(B, [r["tokens_per_s"] for r in rows.values()], "o-", color="C0")
        a1.set_ylabel("tokens/s (batch / median step)")
        a1.set_title("decode throughput vs batch")
        a2.errorbar(B, [r["ms_per_step"]["median"] for r in rows.values()], fmt="o-", color="C1",
                    yerr=np.array([err(r["ms_per_step"]) for r in rows.values()])[:, :, 0].T)
        a2.set_ylabel("ms per step (median, p10-p90)")
        a2.set_title("decode step time vs batch")
        for a in (a1, a2):
            a.set_xscale("log", base=2)
            log_ticks(a, B)
            a.set_xlabel("batch (sequences decoded together)")
        save(fig, "throughput.png")
    if "position" in data:
        rows = data["position"]["rows"]
        P = [r["position"] for r in rows]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        for key, label, c in (("linear_ms", "linear (state)", "C0"), ("softmax_kv_ms", "softmax (KV cache, concatenated)", "C1"),
                              ("softmax_gqa_ms", "softmax (GQA, KV buffer in place)", "C2")):
            have = [r for r in rows if key in r]  # a baseline may be skipped at some positions, or have no twin at all
            if not have:
                continue
            a1.plot([r["position"] for r in have], [r[key]["median"] for r in have], "o-", color=c, label=label)
            a1.fill_between([r["position"] for r in have], [r[key]["p10"] for r in have], [r[key]["p90"] for r in have], color=c, alpha=0.2)
        a1.set_xscale("log")
        a1.set_yscale("log")
        log_ticks(a1, P)
        a1.set_xlabel("position (tokens already seen)")
        a1.set_ylabel("ms per decode step")
        a1.set_title("decode latency vs position")
        a1.legend()
        a2.plot(P, [r["linear_state_bytes"] / 1e6 for r in rows], "o-", label="linear state")
        if "kv_cache_bytes" in rows[0]:
            a2.plot(P, [r["kv_cache_bytes"] / 1e6 for r in rows], "o-", label="softmax KV cache")
        a2.set_xscale("log")
        a2.set_yscale("log")
        log_ticks(a2, P)
        a2.set_xlabel("position")
        a2.set_ylabel("MB per sequence (fp32)")
        a2.set_title("memory per sequence")
        a2.legend()
        save(fig, "position.png")
    if "prefill" in data:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        for i, form in enumerate(data["prefill"]["forms"]):
            ok = [r for r in data["prefill"]["rows"] if r["form"] == form and r["status"] == "ok"]
            if not ok:
                continue
            T = [r["T"] for r in ok]
            a1.errorbar(T, [r["tokens_per_s"] for r in ok], fmt="o-", color=f"C{i}", label=form,
                        yerr=[[r["tokens_per_s"] - r["T"] / r["seconds"]["p90"] for r in ok], [r["T"] / r["seconds"]["p10"] - r["tokens_per_s"] for r in ok]])
            a2.plot(T, [r["peak_increment_bytes"] / 1e6 for r in ok], "o-", color=f"C{i}", label=form)
        skipped = data["prefill"]["skipped"]
        for a in (a1, a2):
            a.set_xscale("log")
            a.set_yscale("log")
            log_ticks(a, list(data["prefill"]["lengths"]))
            a.set_xlabel("prompt length T")
            a.legend(fontsize=7)
        a1.set_ylabel("tokens/s (median, p10-p90)")
        a1.set_title("prefill throughput")
        a2.set_ylabel("peak memory increment, MB")
        a2.set_title("prefill peak memory (subprocess VmHWM)")
        if skipped:
            a2.text(0.01, 0.99, "skipped:\n" + "\n".join(skipped)[:600], transform=a2.transAxes, fontsize=5, va="top")
        save(fig, "prefill.png")
    if "sweep" in data:
        ok = [r for r in data["sweep"]["rows"] if r["status"] == "ok"]
        if ok:
            fig, a1 = plt.subplots(figsize=(6, 4))
            C = [r["chunk"] for r in ok]
            a1.plot(C, [r["tokens_per_s"] for r in ok], "o-", color="C0")
            a1.set_xscale("log", base=2)
            log_ticks(a1, C)
            a1.set_xlabel("chunk size")
            a1.set_ylabel("prefill tokens/s", color="C0")
            a2 = a1.twinx()
            a2.plot(C, [r["peak_increment_bytes"] / 1e6 for r in ok], "s--", color="C1")
            a2.set_ylabel("peak memory increment, MB", color="C1")
            a1.set_title(f"chunk size sweep at T={data['sweep']['length']:,}")
            save(fig, "sweep.png")
    if "floor" in data:
        fig, ax = plt.subplots(figsize=(6, 4))
        rows = data["floor"]["batches"]
        labels = list(rows)
        ax.bar([i - 0.2 for i in range(len(labels))], [rows[b]["floor_ms_per_token"] for b in labels], 0.4, label="floor (bytes / bandwidth)")
        ax.bar([i + 0.2 for i in range(len(labels))], [rows[b]["measured_ms_per_token"] for b in labels], 0.4, label="measured (ORT IO binding)")
        ax.set_xticks(range(len(labels)), [f"batch {b}" for b in labels])
        ax.set_ylabel("ms per token")
        ax.set_title(f"decode floor at {data['floor']['bandwidth_GBps']['max']:.1f} GB/s copy bandwidth")
        ax.legend()
        save(fig, "floor.png")
    return files, {"files": [p.name for p in files], "skipped": None}


__all__ = ["BENCH_PLOT", "PLOT_FILES", "PLOT_SOFTWARE", "write_plots"]
