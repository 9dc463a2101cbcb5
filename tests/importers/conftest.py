"""flash-linear-attention's own models as the oracle, on a machine without a GPU.

fla's Triton kernels need a GPU. Under ``TRITON_INTERPRET=1`` Triton runs them in its interpreter on CPU
(numpy), slowly but with fla's real code; its autotuner would benchmark every candidate config (which needs a
GPU driver), so it is made to keep the first one. The interpreter runs fla's ``fused_recurrent`` kernels; its
chunk kernels do not run there, so the oracle loads models with ``attn_mode="fused_recurrent"``.

The interpreter is chosen when a kernel is defined, so TRITON_INTERPRET is set here, before any test imports
fla or triton. Tests get the oracle through the ``fla_oracle`` fixture, which skips only if fla cannot be imported
(the test extra installs it: pip install -e '.[test]').
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from testkit.stateful import export_vs_reference, import_vs_reference

from edgelin.upstream_run import interpret_on_cpu  # noqa: E402

_FLA = None


def _fla():
    """fla.models, Triton's interpreter set up as validate's upstream run sets it (edgelin.upstream_run)."""
    global _FLA
    if _FLA is None:
        warnings.filterwarnings("ignore", message=".*Triton is not supported on current platform.*")
        _FLA = pytest.importorskip("fla.models", reason="flash-linear-attention or triton cannot be imported; pip install -e '.[test]'")
        interpret_on_cpu()  # what validate's upstream run does: one autotuner config (the largest blocks), the language patched once per kernel
    return _FLA


@pytest.fixture(scope="session")
def fla_oracle():
    """This module: build(), load(), run() and TINY."""
    _fla()
    return sys.modules[__name__]


# A tiny model: 2 layers, hidden 64, 4 heads of 16, vocab 97; the MLP width is set (fla would round to 256).
SCAN_BOUND = 1024  # tokens per prefill call: the delta rule's scan gets 4 levels at C = 64 (a faster export than at 4,096)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_heads=4, vocab_size=97, intermediate_size=96)


# model_type -> fla's (config class, model class)
CLASSES = {
    "linear_attn": ("LinearAttentionConfig", "LinearAttentionForCausalLM"),
    "retnet": ("RetNetConfig", "RetNetForCausalLM"),
    "gla": ("GLAConfig", "GLAForCausalLM"),
    "delta_net": ("DeltaNetConfig", "DeltaNetForCausalLM"),
    "gated_deltanet": ("GatedDeltaNetConfig", "GatedDeltaNetForCausalLM"),
    "kda": ("KDAConfig", "KDAForCausalLM"),
    "gated_deltaproduct": ("GatedDeltaProductConfig", "GatedDeltaProductForCausalLM"),
    "rwkv7": ("RWKV7Config", "RWKV7ForCausalLM"),
}


def build(folder: Path, *, model_type: str = "linear_attn", seed: int = 0, tied_save: bool = False, **options) -> Path:
    """A random fla causal LM of ``model_type`` saved to ``folder``; every weight perturbed so logits spread.

    ``tied_save``: save with safetensors' ``save_model`` (one copy of each shared tensor), for configs that
    transformers' ``save_pretrained`` refuses to save (tie_feature_map_qk)."""
    config_class, model_class = CLASSES[model_type]
    cfg = getattr(_fla(), config_class)(**{**TINY, **options})
    torch.manual_seed(seed)
    model = getattr(_fla(), model_class)(cfg).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))  # RMSNorm weights start at 1
            elif "embeddings" in name or "lm_head" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))  # logits with a spread of a few units
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


def load(folder: Path, *, fused: bool = False):
    """fla's own model from ``folder``, on fla's recurrent kernels (the ones Triton's interpreter runs).

    fused=False also runs fla's RMSNorm and SwiGLU in PyTorch instead of its fused kernels (fuse_norm,
    fuse_swiglu: the same math; the interpreter makes each kernel launch slow)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    model_type = config["model_type"]
    overrides = {} if fused else {name: False for name in ("fuse_norm", "fuse_swiglu") if name in config}  # RWKV-7 has no fuse_swiglu
    if model_type != "linear_attn":  # there fuse_norm also renames the output norm (g_norm_swish_gate): keep it
        overrides.pop("fuse_norm", None)
    model_class = getattr(_fla(), CLASSES[model_type][1])
    return model_class.from_pretrained(folder, attn_mode="fused_recurrent", **overrides).eval()


@torch.no_grad()
def run(model, prompt: torch.Tensor, steps: torch.Tensor, *, raw: bool = False, stepwise: bool = True):
    """fla's logits for ``prompt`` [B, T] and for each token of ``steps`` [B, n]: (prefill logits [B, T, V],
    n x [B, 1, V], final states), where the final states are one dict per layer: "S" [B, H, K, V] and, with
    norm_feature_map, "z" [B, H, K] (linear_attn), or with ``raw`` fla's cache entries as they are (any family).

    ``stepwise``: the prompt in one forward, then the steps fed one at a time through fla's cache (fla's own decode
    path). Otherwise one causal forward over prompt + steps, each step's logits read at its position: the same
    values (measured: within 6e-6 of the stepwise ones, against the tests' 1e-4), in 45-70 % of the time
    in Triton's interpreter; the tests keep the stepwise run for each family's default case (``STEPWISE``)."""
    if not stepwise:
        T = prompt.shape[1]
        out = model(torch.cat([prompt, steps], dim=1), use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, :T]
        decoded = [out.logits[:, T + t : T + t + 1] for t in range(steps.shape[1])]
    else:
        out = model(prompt, use_cache=True)
        cache, logits = out.past_key_values, out.logits
        decoded = []
        for t in range(steps.shape[1]):
            out = model(steps[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            decoded.append(out.logits)
    if raw:  # fla's own cache entries, one dict per layer
        return logits, decoded, [dict(cache[layer]) for layer in range(len(model.model.layers))]
    states = []
    for layer in range(len(model.model.layers)):
        state = cache[layer]["recurrent_state"]
        if isinstance(state, tuple):  # (S, z [B, 1, H, K])
            states.append({"S": state[0], "z": state[1][:, 0]})
        else:
            states.append({"S": state})
    return logits, decoded, states


# ---- shared by the parity tests of every family ----------------------------------------------------
def import_vs_fla(folder: Path, prompt: torch.Tensor, steps: torch.Tensor, ref_prefill, ref_decode, budget: float):
    """edgelin's import of ``folder`` against fla's logits (testkit.stateful); returns (model, final state)."""
    return import_vs_reference(folder, prompt, steps, ref_prefill, ref_decode, budget, against="fla")


def export_vs_fla(out: Path, prompt: torch.Tensor, steps: torch.Tensor, ref_prefill, ref_decode, budget: float) -> None:
    """The export in ``out`` through edgelin's runtime against fla's logits (testkit.stateful)."""
    export_vs_reference(out, prompt, steps, ref_prefill, ref_decode, budget, against="fla")


def export_matches_fla(case: tuple, model_type: str, out: Path, budget: float) -> Path:
    """Export the checkpoint of ``case`` (from ``cached_case``) to ``out``; its manifest names the family; both
    graphs, driven from the manifest alone, match fla within ``budget``; edgelin's validate of the export against
    the checkpoint (what `edgelin validate OUT --checkpoint PATH` runs) passes. Returns ``out``."""
    from edgelin.exporters import export
    from edgelin.runtime.manifest import Manifest
    from edgelin.validate import validate

    folder, prompt, steps, (ref_prefill, ref_decode, _) = case
    export(folder, out, check=False, max_sequence=SCAN_BOUND)
    manifest = Manifest.load(out)
    assert manifest.model["family"] == f"fla/{model_type}" and manifest.model["source_config"]["model_type"] == model_type
    export_vs_fla(out, prompt, steps, ref_prefill, ref_decode, budget)
    # upstream off: fla's own outputs are compared with the graphs just above; validate's run of fla (its kernels in
    # Triton's interpreter: up to a minute and a half per model) is tested per family in test_upstream.py
    report = validate(out, folder, steps=24, long=300, upstream="off")
    assert report.passed, report.table()
    return out


def cached_case(store: dict, case_id: str, model_type: str, options: dict, tmp_path_factory, *, batch: int, prompt: int,
                steps: int, fused: bool = False, stepwise: bool = True):
    """(checkpoint folder, prompt ids, step ids, fla's results with its raw cache) for one case, built and run once
    per session into ``store``; ``options`` are fla config options, "edit" a change to the saved tensors;
    ``stepwise`` as in ``run``."""
    if case_id not in store:
        from safetensors.torch import load_file, save_file

        options = dict(options)
        edit = options.pop("edit", None)
        folder = build(tmp_path_factory.mktemp(case_id), model_type=model_type, **options)
        if edit is not None:
            tensors = load_file(folder / "model.safetensors")
            edit(tensors)
            save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        gen = torch.Generator().manual_seed(0)
        prompt_ids = torch.randint(0, TINY["vocab_size"], (batch, prompt), generator=gen)
        step_ids = torch.randint(0, TINY["vocab_size"], (batch, steps), generator=gen)
        store[case_id] = folder, prompt_ids, step_ids, run(load(folder, fused=fused), prompt_ids, step_ids, raw=True, stepwise=stepwise)
    return store[case_id]


def _refused(folder: Path, *fragments: str) -> str:
    from edgelin.checkpoint import load_checkpoint
    from edgelin.errors import CheckpointError

    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


@pytest.fixture
def refused():
    """refused(folder, *fragments): load_checkpoint(folder) raises a one-line CheckpointError holding every
    fragment; returns the message."""
    return _refused
