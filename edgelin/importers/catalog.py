"""What edgelin exports and what it refuses: the one source of truth for the families.

``FAMILIES`` lists every supported family with what a user needs to pick a checkpoint (the framework it comes
from, its ``model_type`` values and classes, its layer kinds) and where its importer lives; the importer registry
(``edgelin.importers.IMPORTERS``), ``edgelin models``, ``edgelin export --help`` and the README's table are made
from it (a test holds the README's table to it). ``KNOWN`` names the families edgelin does not export yet with what
blocks each, so that a refusal says why and what to do instead of listing names.

Torch-free: the CLI reads it to print help.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FLA, TRANSFORMERS = "fla", "transformers"
FRAMEWORK_NAMES = {FLA: "flash-linear-attention", TRANSFORMERS: "transformers"}
PRECISIONS = ("fp32", "fp16", "int8", "int4")
# The runtimes are driven by the manifest alone, so every export runs in each.
RUNTIMES = ("Python", "node", "browser")
HELD_TO = {FLA: "fla's own model (Triton's interpreter on CPU)", TRANSFORMERS: "transformers' own model and its generate"}

NEXT_STEP = ("`edgelin models` lists the families edgelin exports; to ask for this one, open an issue with its config.json; "
             "a model of your own exports through the model protocol (docs/your-model.md)")


@dataclass(frozen=True)
class ModelFamily:
    """A family edgelin exports: one importer module (``module.function``) for its ``model_types``."""

    name: str  # what users call it
    framework: str  # FLA or TRANSFORMERS
    model_types: tuple[str, ...]
    classes: tuple[str, ...]  # the classes whose save_pretrained folders import
    layers: tuple[str, ...]  # the layer kinds a checkpoint of the family may hold
    module: str
    functions: tuple[str, ...]  # the importer function per model_type, in the order of model_types
    limits: str = ""  # what of the family is refused, said in a few words

    @property
    def held_to(self) -> str:
        return HELD_TO[self.framework]


def _fla(name: str, model_type: str, cls: str, layers: tuple[str, ...]) -> ModelFamily:
    return ModelFamily(name, FLA, (model_type,), (cls,), layers + ("softmax attention (optional, `attn`)",),
                       f"edgelin.importers.fla.{model_type}", ("load",))


FAMILIES: tuple[ModelFamily, ...] = (
    _fla("Linear attention", "linear_attn", "LinearAttentionForCausalLM", ("linear attention with fla's feature maps",)),
    _fla("RetNet", "retnet", "RetNetForCausalLM", ("retention (a fixed decay per head)",)),
    _fla("GLA", "gla", "GLAForCausalLM", ("gated linear attention (a decay per channel)", "short conv (optional)")),
    _fla("DeltaNet", "delta_net", "DeltaNetForCausalLM", ("delta rule", "short conv (optional)")),
    _fla("Gated DeltaNet", "gated_deltanet", "GatedDeltaNetForCausalLM", ("gated delta rule", "short conv (optional)")),
    _fla("Kimi Delta Attention", "kda", "KDAForCausalLM", ("gated delta rule, a gate per channel", "short conv (optional)")),
    _fla("Gated DeltaProduct", "gated_deltaproduct", "GatedDeltaProductForCausalLM",
         ("gated delta rule, several Householder steps per token", "short conv (optional)")),
    _fla("RWKV-7", "rwkv7", "RWKV7ForCausalLM",
         ("RWKV-7 time mix (the generalised delta rule, token shift, value residual)", "token-shift channel mix")),
    ModelFamily("Qwen3.5", TRANSFORMERS, ("qwen3_5", "qwen3_5_text"), ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"),
                ("gated delta rule + short conv", "gated softmax attention"), "edgelin.importers.hf.qwen3_5", ("load", "load_text"),
                "text model only (a vision tower is left out, said in the manifest); dense MLPs only"),
    ModelFamily("Qwen3.5-MoE", TRANSFORMERS, ("qwen3_5_moe", "qwen3_5_moe_text"),
                ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"),
                ("gated delta rule + short conv", "gated softmax attention", "mixture-of-experts MLP"),
                "edgelin.importers.hf.qwen3_5", ("load_moe", "load_moe_text"),
                "text model only (a vision tower is left out, said in the manifest)"),
    ModelFamily("Qwen3-Next", TRANSFORMERS, ("qwen3_next",), ("Qwen3NextForCausalLM",),
                ("gated delta rule + short conv", "gated softmax attention", "mixture-of-experts MLP"),
                "edgelin.importers.hf.qwen3_next", ("load",)),
    ModelFamily("LFM2, LFM2.5", TRANSFORMERS, ("lfm2",), ("Lfm2ForCausalLM",), ("gated short conv", "softmax attention"),
                "edgelin.importers.hf.lfm2", ("load",)),
    ModelFamily("LFM2-MoE", TRANSFORMERS, ("lfm2_moe",), ("Lfm2MoeForCausalLM",),
                ("gated short conv", "softmax attention", "mixture-of-experts MLP"), "edgelin.importers.hf.lfm2", ("load_moe",)),
    ModelFamily("Mamba2", TRANSFORMERS, ("mamba2",), ("Mamba2ForCausalLM",), ("Mamba2 (SSD)",), "edgelin.importers.hf.mamba2", ("load",)),
    ModelFamily("Bamba", TRANSFORMERS, ("bamba",), ("BambaForCausalLM",), ("Mamba2 (SSD)", "softmax attention"),
                "edgelin.importers.hf.bamba", ("load",)),
    ModelFamily("Granite-4.0-H", TRANSFORMERS, ("granitemoehybrid",), ("GraniteMoeHybridForCausalLM",),
                ("Mamba2 (SSD)", "softmax attention (no position encoding)", "dense or mixture-of-experts MLP"),
                "edgelin.importers.hf.granitemoehybrid", ("load",)),
    ModelFamily("Nemotron-H", TRANSFORMERS, ("nemotron_h",), ("NemotronHForCausalLM",),
                ("Mamba2 (SSD)", "softmax attention (no position encoding)", "MLP-only layers", "mixture-of-experts layers"),
                "edgelin.importers.hf.nemotron_h", ("load",)),
    ModelFamily("LFM3", TRANSFORMERS, ("lfm3",), ("Lfm3ForCausalLM",),
                ("gated short conv", "softmax attention (full and sliding-window, a gate per head)"), "edgelin.importers.hf.lfm3",
                ("load",)),
    ModelFamily("OLMo-hybrid", TRANSFORMERS, ("olmo_hybrid",), ("OlmoHybridForCausalLM",),
                ("gated delta rule + short convs", "post-norm softmax attention"), "edgelin.importers.hf.olmo_hybrid", ("load",)),
    ModelFamily("Falcon-H1", TRANSFORMERS, ("falcon_h1",), ("FalconH1ForCausalLM",),
                ("softmax attention and Mamba2 (SSD) in parallel",), "edgelin.importers.hf.falcon_h1", ("load",)),
    ModelFamily("Zamba2", TRANSFORMERS, ("zamba2",), ("Zamba2ForCausalLM",),
                ("Mamba2 (SSD)", "a shared attention block with per-use LoRA adapters"), "edgelin.importers.hf.zamba2", ("load",)),
    ModelFamily("RecurrentGemma", TRANSFORMERS, ("recurrent_gemma",), ("RecurrentGemmaForCausalLM",),
                ("RG-LRU + temporal conv", "local (sliding-window) softmax attention"), "edgelin.importers.hf.recurrent_gemma",
                ("load",)),
    ModelFamily("Mamba, Falcon-Mamba", TRANSFORMERS, ("mamba", "falcon_mamba"), ("MambaForCausalLM", "FalconMambaForCausalLM"),
                ("Mamba-1 selective scan",), "edgelin.importers.hf.mamba", ("load", "load_falcon_mamba"),
                "int4 keeps each out_proj in 8-bit blocks (docs/importers.md)"),
    ModelFamily("Jamba", TRANSFORMERS, ("jamba",), ("JambaForCausalLM",), ("Mamba-1 selective scan", "softmax attention (no position encoding)"),
                "edgelin.importers.hf.jamba", ("load",), "dense MLPs only; int4 keeps the Mamba layers' out_proj in 8 bits"),
)


def family_of(model_type: str) -> ModelFamily | None:
    return next((f for f in FAMILIES if model_type in f.model_types), None)


def model_types(framework: str | None = None) -> tuple[str, ...]:
    return tuple(sorted(t for f in FAMILIES if framework in (None, f.framework) for t in f.model_types))


@dataclass(frozen=True)
class Known:
    """A family edgelin knows of and does not export yet: what it is and what blocks it."""

    name: str
    framework: str
    blocker: str  # what it has that edgelin does not implement ("it has ..., which edgelin does not implement yet")
    instead: str = ""  # the nearest thing that works, where there is one
    reason: str = ""  # said instead of the blocker sentence where the family is out of scope, not yet done

    def why(self) -> str:
        return self.reason or f"it has {self.blocker}, which edgelin does not implement yet"


_SOFTMAX_ONLY = ("it is a softmax-attention transformer with no linear layers, and edgelin exports linear-attention and "
                 "hybrid models (onnxruntime-genai and llama.cpp export this kind)")
_VL = "it is a vision-language model, and edgelin exports text models; none of its importers reads this one's language model"

# model_type -> (framework, what blocks it). The transformers names are transformers 5.24's; the fla ones fla 0.6's.
KNOWN: dict[tuple[str, str], Known] = {
    (TRANSFORMERS, "lfm2_vl"): Known("LFM2-VL", TRANSFORMERS, "", "the text-only LFM2 / LFM2.5 checkpoint (model_type lfm2)",
                                     reason="it is a vision-language checkpoint; edgelin reads LFM2's text model from an lfm2 "
                                            "folder, not from inside a VL one"),
    (TRANSFORMERS, "kimi_linear"): Known("Kimi Linear", TRANSFORMERS, "Kimi Delta Attention (a per-channel gated delta rule), MLA attention "
                                         "and mixture-of-experts MLPs", "Qwen3-Next (a gated delta rule with attention)"),
    (TRANSFORMERS, "minimax"): Known("MiniMax", TRANSFORMERS, "lightning attention with mixture-of-experts MLPs"),
    (TRANSFORMERS, "bailing_hybrid"): Known("Ling hybrid", TRANSFORMERS, "its linear-attention layers with mixture-of-experts MLPs"),
    (TRANSFORMERS, "xlstm"): Known("xLSTM", TRANSFORMERS, "the mLSTM cell (an exponential-gated matrix memory)"),
    (TRANSFORMERS, "rwkv"): Known("RWKV (v4)", TRANSFORMERS, "RWKV-4's time mix", ""),
    (TRANSFORMERS, "gemma3n"): Known("Gemma 3n", TRANSFORMERS, "", reason=_VL),
    (FLA, "rwkv6"): Known("RWKV-6", FLA, "RWKV-6's data-dependent decay with token shift and its bonus term", "GLA (model_type gla)"),
    (FLA, "mamba2"): Known("Mamba2", FLA, "", reason="edgelin's mamba2 importer reads transformers' Mamba2Config, not fla's "
                           "(rmsnorm, norm_before_gate, D_has_hdim, ...)",
                           instead="transformers' Mamba2 (Mamba2ForCausalLM, model_type mamba2)"),
    (FLA, "mamba"): Known("Mamba", FLA, "Mamba-1's selective scan (a decay per channel and state element)"),
    (FLA, "hgrn"): Known("HGRN", FLA, "HGRN's gated elementwise recurrence"),
    (FLA, "hgrn2"): Known("HGRN2", FLA, "HGRN2's state expansion (GLA-like, with its own gates and conventions)", "GLA (model_type gla)"),
    (FLA, "gsa"): Known("GSA", FLA, "gated slot attention (a bounded-memory softmax over slots)"),
    (FLA, "samba"): Known("Samba", FLA, "Mamba-1 layers beside sliding-window attention"),
    (FLA, "comba"): Known("Comba", FLA, "Comba's improved delta rule (its output correction)"),
    (FLA, "mesa_net"): Known("MesaNet", FLA, "MesaNet's in-context optimisation (a solve per token)"),
    (FLA, "transformer"): Known("Transformer", FLA, "", reason=_SOFTMAX_ONLY),
}
for _t in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "gpt2", "olmo2", "smollm3", "granite"):
    KNOWN[(TRANSFORMERS, _t)] = Known(_t, TRANSFORMERS, "", reason=_SOFTMAX_ONLY)
for _t in ("gemma3", "llava", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "smolvlm", "idefics3"):
    KNOWN[(TRANSFORMERS, _t)] = Known(_t, TRANSFORMERS, "", reason=_VL)

# Fields only flash-linear-attention's configs carry (its fused training kernels); transformers' configs never do.
FLA_SIGNATURE = ("fuse_cross_entropy", "fuse_linear_cross_entropy", "use_l2warp", "fuse_norm", "fuse_swiglu")


def framework_of_config(config: dict[str, Any]) -> str:
    """The framework that saved this config.json: fla when it carries one of fla's own fields, transformers otherwise.
    Several model_type names (mamba2, mamba, ...) are used by both."""
    if any(name in config for name in FLA_SIGNATURE):
        return FLA
    return TRANSFORMERS


def accepts(model_type: str, config: dict[str, Any]) -> ModelFamily | None:
    """The family whose importer reads this checkpoint, or None. A name both frameworks use goes to the family's
    framework only: fla's Mamba2 config is not transformers' Mamba2Config."""
    family = family_of(model_type)
    if family is None or (family.framework == TRANSFORMERS and framework_of_config(config) == FLA):
        return None
    return family


def refusal(model_type: str, config: dict[str, Any]) -> str:
    """Why a checkpoint of ``model_type`` (with this config) is not exported, and what to do: one line, no location."""
    saved_by = framework_of_config(config)
    known = KNOWN.get((saved_by, model_type)) or next((k for (_, t), k in KNOWN.items() if t == model_type), None)
    family = family_of(model_type)
    if known is not None:
        what = f"{possessive(FRAMEWORK_NAMES[known.framework])} {known.name} (model_type {model_type!r}) is not supported: {known.why()}"
        instead = f"; the nearest family it exports is {known.instead}" if known.instead else ""
        return f"{what}{instead}. {NEXT_STEP}"
    if family is not None:  # the name of a supported family, saved by the other framework
        return (f"this is a {FRAMEWORK_NAMES[saved_by]} checkpoint (its config has {_signature(config)}) with model_type "
                f"{model_type!r}, which edgelin exports only from {FRAMEWORK_NAMES[family.framework]} ({', '.join(family.classes)}). {NEXT_STEP}")
    names = ", ".join(model_types(saved_by))
    return (f"model_type {model_type!r} is not a family edgelin knows; from {FRAMEWORK_NAMES[saved_by]} it exports {names}. {NEXT_STEP}")


def possessive(name: str) -> str:
    return f"{name}'" if name.endswith("s") else f"{name}'s"


def _signature(config: dict[str, Any]) -> str:
    return next(repr(name) for name in FLA_SIGNATURE if name in config) if framework_of_config(config) == FLA else "no fla fields"


def _rows(refused: bool) -> tuple[list[str], list[list[str]]]:
    if refused:
        head = ["family", "model_type", "framework", "why not yet", "nearest that exports"]
        rows = [[k.name, t, FRAMEWORK_NAMES[fw], k.why(), k.instead or "-"] for (fw, t), k in sorted(KNOWN.items(), key=lambda i: (i[0][0] != TRANSFORMERS, i[0][1]))]
        return head, rows
    head = ["family", "model_type", "framework (classes)", "layer kinds", "precisions", "runtimes", "held to"]
    rows = []
    for f in FAMILIES:
        limits = f" — {f.limits}" if f.limits else ""
        rows.append([f.name, ", ".join(f.model_types), f"{FRAMEWORK_NAMES[f.framework]} ({', '.join(f.classes)})",
                     "; ".join(f.layers) + limits, " ".join(PRECISIONS), ", ".join(RUNTIMES), f.held_to])
    return head, rows


def table_markdown(refused: bool = False) -> str:
    """The supported-models table of the README (``refused``: the families not exported yet), one row per family."""
    head, rows = _rows(refused)
    code = {1}  # the model_type column
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [", ".join(f"`{t.strip()}`" for t in c.split(",")) if i in code else c for i, c in enumerate(row)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table_text(refused: bool = False) -> str:
    """The same rows for a terminal: one block per family."""
    head, rows = _rows(refused)
    width = max(map(len, head))
    blocks = ["\n".join(f"{h:<{width}}  {c}" for h, c in zip(head, row)) for row in rows]
    what = "not exported yet" if refused else "exported"
    return f"{len(rows)} families {what}:\n\n" + "\n\n".join(blocks)


def families_text() -> str:
    """The families in a few lines, for --help and `edgelin models`."""
    out = []
    for framework in (TRANSFORMERS, FLA):
        names = ", ".join(model_types(framework))
        out.append(f"{FRAMEWORK_NAMES[framework]}: {names}")
    return "\n".join(out)


__all__ = ["FAMILIES", "FLA", "KNOWN", "ModelFamily", "Known", "accepts", "NEXT_STEP", "TRANSFORMERS", "families_text", "family_of",
           "framework_of_config", "model_types", "refusal", "table_markdown"]
