"""What an export returns: the files written, the graphs' sizes and times, the smoke check's errors and budgets,
and the summary ``edgelin export`` prints."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from edgelin import parity, upstream
from edgelin.exporters.write import GRAPH_FILES
from edgelin.runtime.manifest import Manifest


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
    peak_bytes: int | None = None  # the process's peak resident memory when the export returned (``peak_resident``)
    peak_own_bytes: int | None = None  # the largest anonymous resident memory seen during the export (``OwnMemoryPeak``)
    streamed: bool = False  # the weights were mapped from a scratch file, not held in memory (edgelin.streaming)

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
        if self.peak_own_bytes is not None:
            lines.append(f"  peak memory of its own: {self.peak_own_bytes / 1e6:,.0f} MB ({OWN_MEANS})")
        if self.peak_bytes is not None:
            lines.append(f"  peak memory: {self.peak_bytes / 1e6:,.0f} MB resident ({PEAK_MEANS})")
        if self.streamed:
            lines.append("  weights: read one tensor at a time and mapped from a scratch file (streamed), never held in memory whole")
        return "\n".join(lines)


PEAK_MEANS = ("ru_maxrss: the process's largest resident set so far, its own memory and the pages it mapped from the "
              "checkpoint and the weights file, which the system can drop and read again")


OWN_MEANS = "RssAnon, sampled every 0.05 s: what had to fit in memory; the mapped weights and files are not in it"


class OwnMemoryPeak:
    """The largest anonymous resident memory (Linux's RssAnon: not the pages of mapped files, which the system can
    drop and read again) of this process between ``start()`` and ``stop()``, sampled every ``interval`` seconds by a
    thread; ``stop()`` returns it in bytes, None where /proc is missing."""

    def __init__(self, interval: float = 0.05) -> None:
        import threading

        self.interval, self.peak, self._stop = interval, None, threading.Event()
        self._thread = threading.Thread(target=self._run, name="edgelin-memory-peak", daemon=True)

    @staticmethod
    def now() -> int | None:
        try:
            with open("/proc/self/status", encoding="ascii") as f:
                for line in f:
                    if line.startswith("RssAnon:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        return None

    def _run(self) -> None:
        while True:
            value = self.now()
            if value is None:
                return
            self.peak = max(self.peak or 0, value)
            if self._stop.wait(self.interval):
                return

    def start(self) -> "OwnMemoryPeak":
        if self.now() is not None:
            self._thread.start()
        return self

    def stop(self) -> int | None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        last = self.now()
        return None if self.peak is None else max(self.peak, last or 0)


def peak_resident() -> int | None:
    """The process's peak resident set in bytes since it started (getrusage's ru_maxrss: kilobytes on Linux, bytes on
    macOS); None where the platform has no getrusage figure."""
    try:
        import resource  # not on Windows

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (ImportError, AttributeError, OSError):
        return None
    return peak * (1 if sys.platform == "darwin" else 1024) if peak > 0 else None
