"""transformers' own model as the oracle, run in a subprocess (``python hf_oracle.py SPEC_JSON``).

The importer tests' process imports fla (its Triton kernels in the interpreter); transformers picks fla's kernels
for its linear-attention layers whenever fla can be imported, and those do not run on a CPU. Here fla is hidden
before transformers is imported, so transformers runs its own PyTorch paths (its torch_chunk / torch_recurrent
gated delta rule and its PyTorch causal conv), in a process of its own so that nothing hidden leaks into the
test process.

SPEC (JSON): {"model_type", "config": {...}, "folder", "out", "seed", "prompt": [[ids]], "steps": [[ids]]}.
Builds the model from the config with the seed, perturbs every weight so that logits spread (norm weights of
zero-centred norms around 0), saves it to ``folder`` with save_pretrained, then runs a prefill of ``prompt``
and each column of ``steps`` through the cache, and writes ``out`` (safetensors): "prefill" [B, T, V],
"decode" [n, B, V], and per layer "{i}.recurrent" / "{i}.conv" / "{i}.key" / "{i}.value" from the cache.
"""

from __future__ import annotations

import json
import sys

CLASSES = {"qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"), "lfm2": ("Lfm2Config", "Lfm2ForCausalLM"),
           "mamba2": ("Mamba2Config", "Mamba2ForCausalLM"), "bamba": ("BambaConfig", "BambaForCausalLM"),
           "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM")}


def main(spec_file: str) -> None:
    sys.modules["fla"] = None  # transformers then falls back to its PyTorch implementations
    import torch
    import transformers
    from safetensors.torch import save_file

    spec = json.loads(open(spec_file).read())
    config_class, model_class = CLASSES[spec["model_type"]]
    cfg = getattr(transformers, config_class)(**spec["config"])
    torch.manual_seed(spec["seed"])
    model = getattr(transformers, model_class)(cfg).eval()
    gen = torch.Generator().manual_seed(spec["seed"] + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight") or (spec["model_type"] != "qwen3_5_text" and name.endswith("norm.weight")):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))  # plain norm weights: around 1
            elif name.endswith("norm.weight"):  # Qwen3.5's zero-centred norms: (1 + w), w around 0
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif "embed" in name or "lm_head" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("A_log", "dt_bias")):
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(spec["folder"])
    prompt, steps = torch.tensor(spec["prompt"]), torch.tensor(spec["steps"])
    cache = transformers.DynamicCache(config=cfg)
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        out["prefill"] = model(prompt, cache=cache, use_cache=True).logits
        # Bamba's model counts positions from 0 on every call unless told (transformers' generate passes them)
        at = (lambda t: {"position_ids": torch.full((steps.shape[0], 1), prompt.shape[1] + t)}) if spec["model_type"] == "bamba" else (lambda t: {})
        decoded = [model(steps[:, t : t + 1], cache=cache, use_cache=True, **at(t)).logits[:, 0] for t in range(steps.shape[1])]
    out["decode"] = torch.stack(decoded) if decoded else torch.zeros(0)
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, transformers.cache_utils.LinearAttentionCacheLayerMixin):
            out[f"{i}.recurrent"], out[f"{i}.conv"] = cache.get_recurrent_state(i), cache.get_conv_state(i)
        else:
            out[f"{i}.key"], out[f"{i}.value"] = layer.keys, layer.values
    save_file({k: v.contiguous().float() for k, v in out.items() if v is not None}, spec["out"])  # LFM2's convs: no recurrent state


def run(model_type: str, config: dict, root, prompt, steps, seed: int = 0):
    """From a test process: build, save and run transformers' model in a subprocess; returns (checkpoint folder,
    the outputs as a dict of tensors)."""
    import subprocess
    from pathlib import Path

    from safetensors.torch import load_file

    root = Path(root)
    spec = {"model_type": model_type, "config": config, "folder": str(root / "ckpt"), "out": str(root / "ref.safetensors"),
            "seed": seed, "prompt": prompt.tolist(), "steps": steps.tolist()}
    (root / "spec.json").write_text(json.dumps(spec))
    done = subprocess.run([sys.executable, __file__, str(root / "spec.json")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "ckpt", load_file(root / "ref.safetensors")


def cached(store: dict, case_id: str, model_type: str, config: dict, tmp_path_factory, *, batch: int, prompt: int,
           steps: int, vocab: int):
    """(checkpoint folder, prompt ids [batch, prompt], step ids [batch, steps], transformers' outputs) for one case,
    built and run once per session into ``store``."""
    if case_id not in store:
        import torch

        gen = torch.Generator().manual_seed(0)
        prompt_ids = torch.randint(0, vocab, (batch, prompt), generator=gen)
        step_ids = torch.randint(0, vocab, (batch, steps), generator=gen)
        folder, ref = run(model_type, config, tmp_path_factory.mktemp(case_id), prompt_ids, step_ids)
        store[case_id] = folder, prompt_ids, step_ids, ref
    return store[case_id]


if __name__ == "__main__":
    main(sys.argv[1])
