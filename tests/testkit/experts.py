"""Mixture-of-experts checkpoints in the other layout transformers knows: experts stacked as it holds them in memory."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch


def fused_experts(folder: Path, out: Path, module: str, gate_up: tuple[str, str], down: str) -> Path:
    """A copy of ``folder`` whose experts are stored as transformers holds them in memory (its conversion mapping:
    per layer ``{module}.experts.gate_up_proj`` = the experts' [gate; up] stacked, [E, 2I, D], and
    ``{module}.experts.down_proj`` [E, D, I])."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    kept, experts = {}, {}
    for name, t in tensors.items():
        m = re.fullmatch(rf"(.*\.{module}\.experts\.)(\d+)\.(\w+)\.weight", name)
        if m is None:
            kept[name] = t
        else:
            experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
    for prefix, parts in experts.items():
        count = 1 + max(e for e, _ in parts)
        kept[prefix + "gate_up_proj"] = torch.stack([torch.cat([parts[(e, gate_up[0])], parts[(e, gate_up[1])]]) for e in range(count)])
        kept[prefix + "down_proj"] = torch.stack([parts[(e, down)] for e in range(count)])
    out.mkdir()
    save_file(kept, out / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(folder / "config.json", out / "config.json")
    return out


def moe_export_matches(folder: Path, prompt, steps, ref: dict, out: Path, tmp_path: Path, max_abs: float, *, moe_layers: int,
                       experts: int | None = None, **export_options) -> None:
    """A mixture-of-experts checkpoint's export held to its framework: ``folder`` exported to ``out`` (no smoke check),
    one TopK per MoE layer in both graphs and, where ``experts`` (per layer) is given, one NonZero and one ScatterND per
    expert (each expert's MatMuls run on its routed rows only), no Loop or Scan; both graphs against the framework's
    outputs ``ref`` (``export_vs_reference``, max abs ``max_abs``); ``validate --upstream required`` passing with its
    routing check over ``moe_layers`` layers; the JavaScript runtime in node (NonZero, GatherND, ScatterND and
    empty rows in onnxruntime-node)."""
    import onnx

    from edgelin.exporters import export
    from edgelin.validate import validate
    from testkit.node import javascript_check
    from testkit.stateful import export_vs_reference

    export(folder, out, check=False, **export_options)
    for graph in ("prefill", "decode"):
        ops = [n.op_type for n in onnx.load(str(out / f"{graph}.onnx"), load_external_data=False).graph.node]
        assert ops.count("TopK") == moe_layers and "Loop" not in ops and "Scan" not in ops, graph
        if experts is not None:
            assert ops.count("NonZero") == ops.count("ScatterND") == experts * moe_layers, graph
    export_vs_reference(out, prompt, steps, ref["prefill"], ref["decode"], max_abs, against="transformers")
    report = validate(out, folder, steps=16, long=300, upstream="required")  # and vs the framework itself
    assert report.passed, report.table()
    routing = [c for c in report.checks if c.group == "routing"]
    assert [c.status for c in routing] == ["pass"] and f"{moe_layers} MoE layers" in routing[0].name, report.table()
    report = javascript_check(out, tmp_path)
    assert report["passed"] and len(report["results"]) == 2, report
