"""What an export writes: the manifest built from the model's state contract, each graph finalised (the manifest
embedded, debug metadata dropped, onnx.checker's full check) and ``edgelin.json`` published with the files' hashes."""

from __future__ import annotations

import shutil
from pathlib import Path

import onnx

from edgelin import __version__, protocol
from edgelin.errors import ExportError
from edgelin.exporters.graphs import INPUT_IDS, LENGTHS, LOGITS, LOGITS_AT
from edgelin.runtime.manifest import MANIFEST_FILE, METADATA_KEY, PREFILL_PIECE, Manifest, file_sha256

GRAPH_FILES = {"prefill": "prefill.onnx", "decode": "decode.onnx"}


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


def finalize_graph(path: Path, manifest_json: str, graph: str) -> onnx.ModelProto:
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


def publish_manifest(tmp: Path, manifest: Manifest, tok) -> Manifest:
    """Embed the manifest in both graphs (full check), hash the files and write edgelin.json; the tokenizer's files
    copied first. Run again when golden.json changes (its hash is in both copies)."""
    embedded_json = manifest.to_json(embedded=True)  # the graphs' copy: no hashes (a file cannot hold its own)
    for graph in GRAPH_FILES:
        finalize_graph(tmp / GRAPH_FILES[graph], embedded_json, graph)
    for name, path in ({} if tok is None else tok.files).items():
        if not (tmp / name).exists():
            shutil.copyfile(path, tmp / name)
        if file_sha256(tmp / name) != tok.spec["files"][name]:
            raise ExportError(f"{path} changed while it was being exported; export again")
    manifest = manifest.with_hashes(tmp)
    (tmp / MANIFEST_FILE).write_text(manifest.to_json(), encoding="utf-8")
    return manifest
