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

A family whose model needs more than that has a module ``testkit/oracles/<model_type>.py`` (imported in the
subprocess when present) with any of: ``CLASSES = (config class, model class)``; ``perturb(model, generator)``
instead of the perturbation here, or ``ROUTERS`` (name suffixes of router weights drawn afresh at std 0.3) and
``BUFFERS`` ({name suffix: std} of buffers drawn after the parameters) beside it; ``make_cache(cfg, model)`` instead of a DynamicCache; ``step_kwargs(spec, t)``
extra keyword arguments of decode step t; ``cache_tensors(cache, out)`` instead of ``read_cache``.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

CLASSES = {"qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"), "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
           "lfm2": ("Lfm2Config", "Lfm2ForCausalLM"),
           "mamba2": ("Mamba2Config", "Mamba2ForCausalLM"), "bamba": ("BambaConfig", "BambaForCausalLM"),
           "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM"),
           "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM")}

ZERO_CENTRED = ("qwen3_5_text", "qwen3_next")  # families whose RMSNorms compute x / rms(x) * (1 + w)


def main(spec_file: str) -> None:
    sys.modules["fla"] = None  # transformers then falls back to its PyTorch implementations
    import torch
    import transformers
    from safetensors.torch import save_file

    spec = json.loads(open(spec_file).read())
    hooks = family_hooks(spec["model_type"])
    config_class, model_class = getattr(hooks, "CLASSES", None) or CLASSES[spec["model_type"]]
    cfg = getattr(transformers, config_class)(**spec["config"])
    torch.manual_seed(spec["seed"])
    model = getattr(transformers, model_class)(cfg).eval()
    gen = torch.Generator().manual_seed(spec["seed"] + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if hasattr(hooks, "perturb"):
                hooks.perturb(model, gen)
                break
            if name.endswith("linear_attn.norm.weight") or (spec["model_type"] not in ZERO_CENTRED and name.endswith("norm.weight")):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))  # plain norm weights: around 1
            elif name.endswith("norm.weight"):  # Qwen3.5's and Qwen3-Next's zero-centred norms: (1 + w), w around 0
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif "embed" in name or "lm_head" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("A_log", "dt_bias")):
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith(getattr(hooks, "ROUTERS", ())):  # mixture-of-experts routers: clear top-k margins
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        for suffix, std in getattr(hooks, "BUFFERS", {}).items():  # buffers the perturbation above leaves as built
            for name, b in model.named_buffers():
                if name.endswith(suffix):
                    b.copy_(std * torch.randn(b.shape, generator=gen))
    model.save_pretrained(spec["folder"])
    prompt, steps = torch.tensor(spec["prompt"]), torch.tensor(spec["steps"])
    cache = hooks.make_cache(cfg, model) if hasattr(hooks, "make_cache") else transformers.DynamicCache(config=cfg)
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        out["prefill"] = model(prompt, cache=cache, use_cache=True).logits
        # Bamba's model counts positions from 0 on every call unless told (transformers' generate passes them)
        at = (lambda t: {"position_ids": torch.full((steps.shape[0], 1), prompt.shape[1] + t)}) if spec["model_type"] == "bamba" else (lambda t: {})
        if hasattr(hooks, "step_kwargs"):
            at = lambda t: hooks.step_kwargs(spec, t)  # noqa: E731
        decoded = [model(steps[:, t : t + 1], cache=cache, use_cache=True, **at(t)).logits[:, 0] for t in range(steps.shape[1])]
    out["decode"] = torch.stack(decoded) if decoded else torch.zeros(0)
    getattr(hooks, "cache_tensors", read_cache)(cache, out)
    save_file({k: v.contiguous().float() for k, v in out.items() if v is not None}, spec["out"])  # LFM2's convs: no recurrent state


def read_cache(cache, out: dict) -> None:
    """transformers' DynamicCache -> out["{i}.recurrent" / "{i}.conv" / "{i}.key" / "{i}.value"]."""
    import transformers

    for i, layer in enumerate(cache.layers):
        if isinstance(layer, transformers.cache_utils.LinearAttentionCacheLayerMixin):
            out[f"{i}.recurrent"], out[f"{i}.conv"] = cache.get_recurrent_state(i), cache.get_conv_state(i)
        else:  # (an MLP layer's cache holds nothing: keys and values None)
            out[f"{i}.key"], out[f"{i}.value"] = layer.keys, layer.values


def family_hooks(model_type: str):
    """testkit/oracles/<model_type>.py, or None (the module docstring)."""
    if not (Path(__file__).parent / "oracles" / f"{model_type}.py").is_file():
        return None
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, so that testkit imports
    return importlib.import_module(f"testkit.oracles.{model_type}")


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


def multimodal(text_folder, out):
    """A qwen3_5 (vision-language) folder around a text checkpoint: the text weights under model.language_model.,
    a vision tensor and an mtp tensor beside them, the text config nested."""
    import torch
    from safetensors.torch import load_file, save_file

    text_cfg = json.loads((text_folder / "config.json").read_text())
    tensors = load_file(text_folder / "model.safetensors")
    renamed = {("lm_head.weight" if k == "lm_head.weight" else k.replace("model.", "model.language_model.", 1)): v for k, v in tensors.items()}
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(8, 3, 2, 2)
    renamed["mtp.fc.weight"] = torch.zeros(4, 4)
    out.mkdir()
    save_file(renamed, out / "model.safetensors", metadata={"format": "pt"})
    cfg = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
           "text_config": text_cfg, "vision_config": {"depth": 1, "hidden_size": 8}, "image_token_id": 90,
           "video_token_id": 91, "vision_start_token_id": 92, "vision_end_token_id": 93,
           "tie_word_embeddings": text_cfg["tie_word_embeddings"]}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _vision_language_main(text_folder: str, out: str) -> None:
    """In a subprocess: transformers' own Qwen3_5ForConditionalGeneration around the text checkpoint's weights (a tiny
    vision tower of its own), saved with save_pretrained as a released Qwen3.5 checkpoint is."""
    sys.modules["fla"] = None
    import torch
    import transformers

    text = transformers.Qwen3_5ForCausalLM.from_pretrained(text_folder).eval()
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": text.config.hidden_size,
              "num_position_embeddings": 16}
    config = transformers.Qwen3_5Config(text_config=text.config.to_dict(), vision_config=vision,
                                        tie_word_embeddings=text.config.tie_word_embeddings)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    model.save_pretrained(out)


def vision_language(text_folder, out):
    """A qwen3_5 vision-language checkpoint written by transformers itself around ``text_folder``'s text weights."""
    import subprocess

    done = subprocess.run([sys.executable, __file__, "--vision-language", str(text_folder), str(out)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


if __name__ == "__main__":
    if sys.argv[1] == "--vision-language":
        _vision_language_main(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1])
