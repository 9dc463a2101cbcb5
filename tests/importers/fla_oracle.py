"""flash-linear-attention's own models as the oracle, on a machine without a GPU.

fla's Triton kernels need a GPU. Under ``TRITON_INTERPRET=1`` Triton runs them in its interpreter on CPU
(numpy), slowly but with fla's real code; its autotuner would benchmark every candidate config (which needs a
GPU driver), so it is made to keep the first one. The interpreter runs fla's ``fused_recurrent`` kernels; its
chunk kernels do not run there, so the oracle loads models with ``attn_mode="fused_recurrent"``.

Import this module before anything imports triton (the interpreter is chosen when a kernel is defined).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

fla_models = pytest.importorskip("fla.models", reason="flash-linear-attention (and triton) are not installed: pip install -e '.[test]'")

import triton.runtime.autotuner as _autotuner  # noqa: E402


def _first_config(self, kwargs):
    return self.configs[:1]


_autotuner.Autotuner.prune_configs = _first_config  # no benchmarking: there is no GPU to time on

warnings.filterwarnings("ignore", message=".*Triton is not supported on current platform.*")

# A tiny model: 2 layers, hidden 64, 4 heads of 16, vocab 97; the MLP width is set (fla would round to 256).
TINY = dict(hidden_size=64, num_hidden_layers=2, num_heads=4, vocab_size=97, intermediate_size=96)


def build(folder: Path, *, seed: int = 0, tied_save: bool = False, **options) -> Path:
    """A random fla LinearAttentionForCausalLM saved to ``folder``; every weight perturbed so logits spread.

    ``tied_save``: save with safetensors' ``save_model`` (one copy of each shared tensor), for configs that
    transformers' ``save_pretrained`` refuses to save (tie_feature_map_qk)."""
    cfg = fla_models.LinearAttentionConfig(**{**TINY, **options})
    torch.manual_seed(seed)
    model = fla_models.LinearAttentionForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))  # RMSNorm weights start at 1
            else:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    folder.mkdir(parents=True, exist_ok=True)
    if tied_save:
        from safetensors.torch import save_model

        save_model(model, str(folder / "model.safetensors"))
        cfg.save_pretrained(folder)
    else:
        model.save_pretrained(folder)
    return folder


def load(folder: Path):
    """fla's own model from ``folder``, on fla's recurrent kernels (the ones Triton's interpreter runs)."""
    return fla_models.LinearAttentionForCausalLM.from_pretrained(folder, attn_mode="fused_recurrent").eval()


@torch.no_grad()
def run(model, prompt: torch.Tensor, steps: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """fla's logits for ``prompt`` [B, T] (one forward, cache kept) and for each token of ``steps`` [B, n]
    fed one at a time through the cache: (prefill logits [B, T, V], n x [B, 1, V])."""
    out = model(prompt, use_cache=True)
    cache, logits = out.past_key_values, out.logits
    decoded = []
    for t in range(steps.shape[1]):
        out = model(steps[:, t : t + 1], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        decoded.append(out.logits)
    return logits, decoded
