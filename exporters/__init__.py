"""edgelin.exporters: a LinearLM -> prefill.onnx + decode.onnx + edgelin.json (uses torch)."""

from edgelin.exporters.exporter import DEFAULT_OPSET, GRAPH_FILES, SMOKE_BUDGET, ExportResult, build_manifest, export
from edgelin.exporters.graphs import DecodeGraph, PrefillGraph, io_names

__all__ = ["DEFAULT_OPSET", "GRAPH_FILES", "SMOKE_BUDGET", "DecodeGraph", "ExportResult", "PrefillGraph", "build_manifest", "export", "io_names"]
