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
