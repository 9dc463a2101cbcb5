"""edgelin.exporters: a model (edgelin.protocol) -> prefill.onnx + decode.onnx + edgelin.json (uses torch)."""

from edgelin.exporters.exporter import DEFAULT_OPSET, GRAPH_FILES, ExportResult, build_manifest, export, export_graph
from edgelin.exporters.graphs import Graph, GraphSpec, graph_spec, io_names

__all__ = ["DEFAULT_OPSET", "GRAPH_FILES", "ExportResult", "Graph", "GraphSpec", "build_manifest", "export", "export_graph", "graph_spec", "io_names"]
