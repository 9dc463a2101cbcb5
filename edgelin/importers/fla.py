"""flash-linear-attention (fla) checkpoints, imported onto edgelin's own pieces.

fla saves its models HF-style: ``config.json`` (with ``model_type``) + ``model.safetensors``. Every fla causal
LM has the same skeleton,

    embeddings -> n x [RMSNorm -> token mixer -> + -> RMSNorm -> SwiGLU MLP -> +] -> RMSNorm -> lm_head

and differs in its token mixer. ``FlaCausalLM`` is that skeleton (edgelin's RMSNorm and SwiGLU) over an
attention layer built by a family's builder; ``FAMILIES`` maps a ``model_type`` to its ``Family`` (the config
fields it knows, the layer builder, the weight renames). The layers call edgelin's attention forms
(``edgelin.ops``) and feature-map registry, so the math lives in one place.

Conventions of fla, carried over exactly (see docs/importers.md):
- q goes through the feature map, then (``norm_q``) phi(q) / (sum phi(q) + 1e-4), then times F^-0.5, where F is
  the feature width (2 D for hedgehog, 8 D for dpfp); keys likewise without the scale (``norm_k``).
- With ``norm_feature_map`` the output is divided by the running denominator with fla's epsilon 1e-10 added
  to the *scaled* denominator; without it there is no denominator. A per-head RMSNorm (weight only with
  ``elementwise_affine``) always follows.
- ``num_kv_heads``: query head h reads key/value head h // (num_heads / num_kv_heads). Every query head of a
  group would build the same state, so the state is carried once per key/value head.
- MLP width: ``intermediate_size``, or hidden * hidden_ratio * 2/3 rounded up to a multiple of 256.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from edgelin.errors import CheckpointError
from edgelin.feature_maps import Adjusted, FeatureMap, make_feature_map
from edgelin.importers import CONFIG_FILE, read_config
from edgelin.importers.weights import WEIGHTS_FILE, Renamer, load_weights, match, read_safetensors
from edgelin.model import RMSNorm, SwiGLU
from edgelin.ops import FORMS, State, recurrent_step, state_layout
from edgelin.protocol import DEFAULT_CHUNK
from edgelin.runtime.manifest import StateSpec
from edgelin.safety import expected_shapes, header_shapes
from edgelin.state import fresh_state

# Fields of any HF-style config that do not change what the model computes.
GENERIC_FIELDS = frozenset({
    "model_type", "architectures", "transformers_version", "dtype", "torch_dtype", "_name_or_path",
    "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "initializer_range", "max_position_embeddings",
    "return_dict", "output_hidden_states", "output_attentions", "use_return_dict", "tokenizer_class",
    "id2label", "label2id", "problem_type", "is_encoder_decoder", "keys_to_ignore_at_inference",
})

# Fields shared by fla's causal LMs, with fla's defaults. The fuse_* options and use_l2warp select kernels or a
# training loss: the same math at inference (fuse_norm fuses the residual add into the RMSNorm, fuse_swiglu the
# SwiGLU into the down projection), so they are accepted whatever their value.
COMMON_FIELDS: dict[str, Any] = {
    "vocab_size": 32000, "hidden_size": 2048, "num_hidden_layers": 24, "norm_eps": 1e-6,
    "hidden_ratio": 4, "intermediate_size": None, "hidden_act": "swish", "tie_word_embeddings": False,
    "fuse_norm": True, "fuse_swiglu": True, "fuse_cross_entropy": True, "fuse_linear_cross_entropy": False,
    "use_l2warp": False,
}

# Options edgelin does not implement: refused unless unset, with what they are.
REFUSED_FIELDS: dict[str, str] = {
    "attn": "hybrid softmax-attention layers",
    "attnres_block_size": "attention residuals across blocks",
}


class Fields:
    """Typed reads of a config dict with a family's defaults; every error names the field."""

    def __init__(self, data: dict[str, Any], defaults: dict[str, Any], where: Path) -> None:
        self.data, self.defaults, self.where = data, defaults, where

    def fail(self, name: str, message: str) -> CheckpointError:
        return CheckpointError(f"{self.where}: config field {name!r} {message}")

    def get(self, name: str) -> Any:
        return self.data.get(name, self.defaults[name])

    def integer(self, name: str, *, optional: bool = False) -> int | None:
        value = self.get(name)
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self.fail(name, f"must be a positive integer{' or null' if optional else ''}, got {value!r}")
        return value

    def number(self, name: str) -> float:
        value = self.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
            raise self.fail(name, f"must be a positive finite number, got {value!r}")
        return float(value)

    def flag(self, name: str) -> bool:
        value = self.get(name)
        if not isinstance(value, bool):
            raise self.fail(name, f"must be true or false, got {value!r}")
        return value

    def choice(self, name: str, allowed: tuple[str, ...]) -> str:
        value = self.get(name)
        if value not in allowed:
            raise self.fail(name, f"is {value!r}; edgelin supports {', '.join(map(repr, allowed))}")
        return value


@dataclass(frozen=True)
class Common:
    """The skeleton's sizes, read from the fields every fla causal LM shares."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    norm_eps: float
    mlp_hidden: int
    tie_embeddings: bool

    @classmethod
    def read(cls, f: Fields) -> "Common":
        hidden = f.integer("hidden_size")
        f.choice("hidden_act", ("swish",))
        for name in ("fuse_norm", "fuse_swiglu", "fuse_cross_entropy", "fuse_linear_cross_entropy", "use_l2warp"):
            f.flag(name)
        mlp = f.integer("intermediate_size", optional=True)
        if mlp is None:
            ratio = f.get("hidden_ratio")
            ratio = 4 if ratio is None else ratio
            if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not ratio > 0:
                raise f.fail("hidden_ratio", f"must be a positive number or null, got {ratio!r}")
            mlp = 256 * ((int(hidden * ratio * 2 / 3) + 255) // 256)  # fla's rounding: up to a multiple of 256
        return cls(
            vocab_size=f.integer("vocab_size"), hidden_size=hidden, num_layers=f.integer("num_hidden_layers"),
            norm_eps=f.number("norm_eps"), mlp_hidden=mlp, tie_embeddings=f.flag("tie_word_embeddings"),
        )


@dataclass(frozen=True)
class Family:
    """One fla model type: its own config fields (with fla's defaults), how to build one attention layer from
    them, and the renames from fla's tensor names to the layer's (fragments, see ``Renamer``)."""

    name: str  # e.g. "fla/linear_attn"
    fields: dict[str, Any]
    read: Callable[[Fields, Common], Any]  # -> the layer options
    make_layer: Callable[[Any, Common], nn.Module]
    renames: Callable[[Any], list[tuple[str, str]]] = field(default=lambda options: [])
    chunk_size: int = DEFAULT_CHUNK  # the prefill chunk it exports with (per-feature decays want a smaller one)


FAMILIES: dict[str, Family] = {}


def check_fields(data: dict[str, Any], family: Family, where: Path) -> Fields:
    """Refuse an unknown field or a set refused option, naming the field; return typed access to the rest."""
    known = GENERIC_FIELDS | set(COMMON_FIELDS) | set(REFUSED_FIELDS) | set(family.fields)
    unknown = sorted(set(data) - known)
    if unknown:
        raise CheckpointError(
            f"{where}: config field {unknown[0]!r} is unknown to edgelin's {family.name} importer; it may change the "
            f"model, so the checkpoint is refused"
        )
    for name, what in REFUSED_FIELDS.items():
        if data.get(name) is not None:
            raise CheckpointError(f"{where}: config field {name!r} is set ({what}); edgelin does not support it")
    return Fields(data, {**COMMON_FIELDS, **{name: None for name in REFUSED_FIELDS}, **family.fields}, where)


# ---- the skeleton --------------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, attn: nn.Module, common: Common) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(common.hidden_size, common.norm_eps)
        self.attn = attn
        self.mlp_norm = RMSNorm(common.hidden_size, common.norm_eps)
        self.mlp = SwiGLU(SimpleNamespace(d_model=common.hidden_size, mlp_hidden=common.mlp_hidden))

    def run(self, x: torch.Tensor, state: State, chunk_size: int | None) -> tuple[torch.Tensor, State]:
        """chunk_size None: one token through the recurrent step (the decode graph)."""
        h, state = self.attn(self.attn_norm(x), state, chunk_size)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), state


class FlaCausalLM(nn.Module):
    """An fla causal LM on edgelin's pieces; follows edgelin's model protocol (forward, step, state_specs)."""

    def __init__(self, family: Family, source: dict[str, Any], options: Any, common: Common, chunk_size: int = DEFAULT_CHUNK) -> None:
        super().__init__()
        self.family, self.source, self.options, self.common = family, source, options, common
        self.vocab_size = common.vocab_size
        self.chunk_size = chunk_size
        self.model = nn.Module()
        self.model.embeddings = nn.Embedding(common.vocab_size, common.hidden_size)
        self.model.layers = nn.ModuleList(Block(family.make_layer(options, common), common) for _ in range(common.num_layers))
        self.model.norm = RMSNorm(common.hidden_size, common.norm_eps)
        self.lm_head = None if common.tie_embeddings else nn.Linear(common.hidden_size, common.vocab_size, bias=False)

    # ---- the model protocol (edgelin.protocol) --------------------------------------------------------------
    @property
    def state_decays(self) -> bool:
        """RetNet's and GLA's states decay; linear_attn's sums every token."""
        return getattr(self.options, "decay", "none") != "none"

    def state_specs(self) -> tuple[StateSpec, ...]:
        """The state contract, in graph order: per layer the attention's state (S, and z with the denominator)."""
        return tuple(
            StateSpec.for_key(f"{i}.{name}", shape, dtype, init)
            for i, block in enumerate(self.model.layers)
            for name, (shape, dtype, init) in block.attn.state_layout().items()
        )

    def model_config(self) -> dict[str, Any]:
        """The manifest's "model" field: the family, the prefill chunk and the checkpoint's own config.json."""
        return {"family": self.family.name, "chunk_size": self.chunk_size, "source_config": self.source}

    def with_chunk_size(self, chunk_size: int) -> "FlaCausalLM":
        """The same weights with another prefill chunk (the chunk changes no result, only speed)."""
        if chunk_size == self.chunk_size:
            return self
        model = FlaCausalLM(self.family, self.source, self.options, self.common, chunk_size).to(self.model.embeddings.weight.dtype)
        model.load_state_dict(self.state_dict())
        return model.train(self.training)

    def init_state(self, batch: int) -> State:
        p = self.model.embeddings.weight
        return fresh_state(self.state_specs(), batch, dtype=p.dtype, device=p.device)

    def forward(self, input_ids: torch.Tensor, state: State | None = None) -> tuple[torch.Tensor, State]:
        """input_ids [B, T] -> logits [B, T, vocab] and the state after the last token (chunked form)."""
        return self._run(input_ids, state, self.chunk_size)

    def step(self, input_ids: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        """input_ids [B, 1] -> logits [B, 1, vocab] and the next state (recurrent form)."""
        return self._run(input_ids, state, None)

    def _run(self, input_ids: torch.Tensor, state: State | None, chunk_size: int | None) -> tuple[torch.Tensor, State]:
        if state is None:
            state = self.init_state(input_ids.shape[0])
        x = self.model.embeddings(input_ids)  # [B, T, hidden]
        new_state: State = {}
        for i, block in enumerate(self.model.layers):
            prefix = f"{i}."
            layer = {key[len(prefix):]: t for key, t in state.items() if key.startswith(prefix)}
            x, layer = block.run(x, layer, chunk_size)
            new_state.update({f"{i}.{name}": t for name, t in layer.items()})
        x = self.model.norm(x)
        logits = x @ self.model.embeddings.weight.T if self.lm_head is None else self.lm_head(x)  # [B, T, vocab]
        return logits, new_state


def load_fla(path: str | Path, model_type: str) -> FlaCausalLM:
    """Build the edgelin model of an fla checkpoint folder of ``model_type`` (eval mode, float32, CPU)."""
    path = Path(path)
    family = FAMILIES[model_type]
    source = read_config(path)
    f = check_fields(source, family, path / CONFIG_FILE)
    common = Common.read(f)
    options = family.read(f, common)
    pairs = [(".mlp.gate_proj.", ".mlp.gate."), (".mlp.up_proj.", ".mlp.up."), (".mlp.down_proj.", ".mlp.down.")]
    if common.tie_embeddings:
        pairs.append(("lm_head.weight", "model.embeddings.weight"))  # a tied checkpoint may hold either copy
    rename = Renamer(pairs + family.renames(options))
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(f"{path} has no {WEIGHTS_FILE}")
    # names and shapes first, from the config (a model on the meta device) and the file's header: a config
    # that disagrees with the weights is refused before memory is spent on either
    expected = expected_shapes(lambda: FlaCausalLM(family, source, options, common, family.chunk_size))
    groups = match(expected, header_shapes(weights), rename, weights)
    model = FlaCausalLM(family, source, options, common, family.chunk_size)
    load_weights(model, read_safetensors(path), groups, weights)
    return model.eval()


# ---- pieces shared by the attention layers ---------------------------------------------------------------------


def split_heads(x: torch.Tensor, heads: int, dim: int, groups: int = 1) -> torch.Tensor:
    """[B, T, heads * dim] -> [B, heads * groups, T, dim]: each head repeated ``groups`` times in a row (query
    head h reads key/value head h // groups)."""
    B, T, _ = x.shape
    x = x.view(B, T, heads, dim).transpose(1, 2)  # [B, heads, T, dim]
    if groups == 1:
        return x
    return x[:, :, None].expand(B, heads, groups, T, dim).reshape(B, heads * groups, T, dim)  # [B, H, T, dim]


def share_state(state: State, groups: int) -> State:
    """Per key/value head -> per query head (query head h reads key/value head h // groups)."""
    if groups == 1:
        return state
    out = {}
    for name, t in state.items():
        B, Hkv, *rest = t.shape
        out[name] = t[:, :, None].expand(B, Hkv, groups, *rest).reshape(B, Hkv * groups, *rest)  # [B, H, ...]
    return out


def unshare_state(state: State, groups: int) -> State:
    """Per query head -> per key/value head: the heads of a group built identical states; keep the first."""
    if groups == 1:
        return state
    return {name: t[:, ::groups] for name, t in state.items()}  # [B, Hkv, ...]


# ---- linear_attn: LinearAttentionForCausalLM -------------------------------------------------------------------

# fla's feature_map value -> edgelin's registry name
LINEAR_ATTN_MAPS = {
    "identity": "identity", "elu": "elu+1", "relu": "relu",
    "elementwise_product": "elementwise_product", "hedgehog": "hedgehog", "t2r": "t2r", "dpfp": "dpfp",
}
FLA_DENOMINATOR_EPS = 1e-10  # added to the scaled denominator
# The ONNX exporter's graph optimizer drops an added constant below 1e-8 as if it were zero (measured with
# torch 2.13 + onnxscript 0.7.2), which would turn 0 / 0 into NaN where the denominator is exactly zero (dpfp's
# sparse features make that happen). With the denominator, q is scaled by a further 2^14: numerator and
# denominator grow alike (exactly, a power of two), and the epsilon becomes 2^14 * 1e-10 = 1.6e-6.
DENOMINATOR_GAIN = 2.0**14
FLA_SUM_NORM_EPS = 1e-4  # norm_q / norm_k: phi / (sum phi + 1e-4)


@dataclass(frozen=True)
class LinearAttnOptions:
    num_heads: int
    num_kv_heads: int
    head_k_dim: int
    head_v_dim: int
    feature_map: str  # edgelin's registry name
    tie_qk: bool
    norm_q: bool
    norm_k: bool
    normalize: bool  # norm_feature_map: divide by the running denominator
    elementwise_affine: bool


def read_heads(f: Fields, common: Common) -> tuple[int, int, int, int]:
    """(num_heads, num_kv_heads, head_k_dim, head_v_dim) from num_heads, num_kv_heads, expand_k, expand_v."""
    heads = f.integer("num_heads")
    kv_heads = f.integer("num_kv_heads", optional=True) or heads
    if heads % kv_heads:
        raise f.fail("num_kv_heads", f"must divide num_heads ({heads}), got {kv_heads}")
    dims = {}
    for name in ("expand_k", "expand_v"):
        width = common.hidden_size * f.number(name)
        if not math.isclose(width, round(width)) or round(width) % heads:
            raise f.fail(name, f"gives a width hidden_size * {name} = {width:g}; it must be an integer divisible by num_heads ({heads})")
        dims[name] = round(width) // heads
    return heads, kv_heads, dims["expand_k"], dims["expand_v"]


def read_linear_attn(f: Fields, common: Common) -> LinearAttnOptions:
    heads, kv_heads, head_k_dim, head_v_dim = read_heads(f, common)
    fm = f.get("feature_map")
    if fm not in LINEAR_ATTN_MAPS:
        raise f.fail("feature_map", f"is {fm!r}; edgelin supports {', '.join(map(repr, LINEAR_ATTN_MAPS))}")
    return LinearAttnOptions(
        num_heads=heads, num_kv_heads=kv_heads, head_k_dim=head_k_dim, head_v_dim=head_v_dim,
        feature_map=LINEAR_ATTN_MAPS[fm], tie_qk=f.flag("tie_feature_map_qk"), norm_q=f.flag("norm_q"),
        norm_k=f.flag("norm_k"), normalize=f.flag("norm_feature_map"), elementwise_affine=f.flag("elementwise_affine"),
    )


class FlaLinearAttention(nn.Module):
    """fla's LinearAttention layer on edgelin's forms; the state is carried per key/value head."""

    def __init__(self, o: LinearAttnOptions, common: Common) -> None:
        super().__init__()
        self.o = o
        self.groups = o.num_heads // o.num_kv_heads
        hidden = common.hidden_size
        self.q_proj = nn.Linear(hidden, o.num_heads * o.head_k_dim, bias=False)
        self.k_proj = nn.Linear(hidden, o.num_kv_heads * o.head_k_dim, bias=False)
        self.v_proj = nn.Linear(hidden, o.num_kv_heads * o.head_v_dim, bias=False)
        self.o_proj = nn.Linear(o.num_heads * o.head_v_dim, hidden, bias=False)
        inner: FeatureMap = make_feature_map(o.feature_map, o.head_k_dim, tie_qk=o.tie_qk)
        gain = DENOMINATOR_GAIN if o.normalize else 1.0
        self.eps = FLA_DENOMINATOR_EPS * gain
        self.phi = Adjusted(
            inner, query_scale=inner.out_dim**-0.5 * gain, sum_norm_query=o.norm_q, sum_norm_key=o.norm_k,
            sum_eps=FLA_SUM_NORM_EPS,
        )
        self.norm = RMSNorm(o.head_v_dim, common.norm_eps)
        if not o.elementwise_affine:  # fla's output norm then has no weight: a fixed 1, not in the checkpoint
            del self.norm.weight
            self.norm.register_buffer("weight", torch.ones(o.head_v_dim), persistent=False)

    def state_layout(self) -> dict[str, tuple]:
        return state_layout(self.phi, n_heads=self.o.num_kv_heads, value_dim=self.o.head_v_dim, normalize=self.o.normalize)

    def _heads(self, x: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
        return split_heads(x, heads, dim, self.groups if heads != self.o.num_heads else 1)  # [B, H, T, dim]

    def _share(self, state: State) -> State:
        return share_state(state, self.groups)

    def _unshare(self, state: State) -> State:
        return unshare_state(state, self.groups)

    def forward(self, x: torch.Tensor, state: State, chunk_size: int | None) -> tuple[torch.Tensor, State]:
        o = self.o
        q = self._heads(self.q_proj(x), o.num_heads, o.head_k_dim)  # [B, H, T, Dk]
        k = self._heads(self.k_proj(x), o.num_kv_heads, o.head_k_dim)  # [B, H, T, Dk]
        v = self._heads(self.v_proj(x), o.num_kv_heads, o.head_v_dim)  # [B, H, T, Dv]
        common = dict(feature_map=self.phi, initial_state=self._share(state), eps=self.eps, normalize=o.normalize)
        if chunk_size is None:
            y, state = recurrent_step(q, k, v, **common)  # [B, H, 1, Dv]
        else:
            y, state = FORMS["chunk"](q, k, v, chunk_size=chunk_size, **common)  # [B, H, T, Dv]
        y = self.norm(y)
        B, H, T, D = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * D)), self._unshare(state)  # [B, T, hidden]


def linear_attn_renames(o: LinearAttnOptions) -> list[tuple[str, str]]:
    if o.feature_map not in ("elementwise_product", "hedgehog", "t2r"):  # no parameters
        return []
    # tied maps are one module saved under either name (or both)
    return [(".attn.feature_map_q.", ".attn.phi.inner.q."), (".attn.feature_map_k.", ".attn.phi.inner.q." if o.tie_qk else ".attn.phi.inner.k.")]


FAMILIES["linear_attn"] = Family(
    name="fla/linear_attn",
    fields={
        "expand_k": 1.0, "expand_v": 1.0, "num_heads": 4, "num_kv_heads": None, "feature_map": "elementwise_product",
        "tie_feature_map_qk": False, "norm_q": False, "norm_k": False, "norm_feature_map": False,
        "elementwise_affine": True,
        "attn_mode": "fused_chunk",  # which fla kernel runs the same math: no effect here
    },
    read=read_linear_attn,
    make_layer=FlaLinearAttention,
    renames=linear_attn_renames,
)


def load_linear_attn(path: str | Path) -> FlaCausalLM:
    return load_fla(path, "linear_attn")


# ---- RetNet and GLA: the gated families -----------------------------------------------------------------------

# fla's feature_map for RetNet and GLA: an activation on q and k (None: none), before the rotary (RetNet) and
# before the kernel's K^-0.5 query scale. Both families' activation tables give these the same functions.
GATED_FEATURE_MAPS: dict[str | None, Callable[[torch.Tensor], torch.Tensor] | None] = {
    None: None, "relu": torch.relu, "sigmoid": torch.sigmoid, "swish": F.silu, "silu": F.silu,
}
GLA_GATE_NORMALIZER = 16  # fla's GatedLinearAttention default; its model does not pass the config's
GLA_GATE_RANK = 16  # the low-rank gate projection's width (likewise fixed by the model)
ROTARY_BASE = 10000.0


def read_feature_activation(f: Fields) -> str | None:
    fm = f.get("feature_map")
    if fm not in GATED_FEATURE_MAPS:
        allowed = ", ".join(repr(n) for n in GATED_FEATURE_MAPS if n is not None)
        raise f.fail("feature_map", f"is {fm!r}; edgelin supports null, {allowed}")
    return fm


@dataclass(frozen=True)
class GatedOptions:
    """The attention layer of fla's RetNet (``decay="fixed"``) or GLA (``decay="gla"``)."""

    decay: str  # "fixed": gamma_h = 1 - 2^(-5-h) per head, with rotary positions; "gla": the data-dependent gate
    num_heads: int
    num_kv_heads: int
    head_k_dim: int
    head_v_dim: int
    feature_map: str | None  # a GATED_FEATURE_MAPS key
    output_gate: bool  # g_proj: RMSNorm(o) * swish(g_proj(x)); else RMSNorm(o)
    elementwise_affine: bool
    short_conv: bool = False  # GLA: depthwise causal convs (+ SiLU) after the q, k, v projections
    conv_size: int = 4
    clamp_min: float | None = None  # GLA: lower bound of the log-gate


def read_retnet(f: Fields, common: Common) -> GatedOptions:
    heads, kv_heads, head_k_dim, head_v_dim = read_heads(f, common)
    if head_k_dim % 2 or head_k_dim > 256:
        raise f.fail("expand_k", f"gives a key head width of {head_k_dim}; fla's rotary needs an even width <= 256")
    f.flag("use_short_conv")  # fla's RetNet model does not pass it (nor conv_size) to its layer: no convs
    f.integer("conv_size")
    return GatedOptions(
        decay="fixed", num_heads=heads, num_kv_heads=kv_heads, head_k_dim=head_k_dim, head_v_dim=head_v_dim,
        feature_map=read_feature_activation(f), output_gate=f.flag("use_output_gate"),
        elementwise_affine=f.flag("elementwise_affine"),
    )


def read_gla(f: Fields, common: Common) -> GatedOptions:
    heads, kv_heads, head_k_dim, head_v_dim = read_heads(f, common)
    clamp = f.get("clamp_min")
    if clamp is not None and (isinstance(clamp, bool) or not isinstance(clamp, (int, float)) or not (clamp < 0 and math.isfinite(clamp))):
        raise f.fail("clamp_min", f"must be a negative finite number or null, got {clamp!r}")
    f.flag("use_gk")  # fla's GLA model does not pass use_gk / use_gv to its layer: always the key gate only
    f.flag("use_gv")
    return GatedOptions(
        decay="gla", num_heads=heads, num_kv_heads=kv_heads, head_k_dim=head_k_dim, head_v_dim=head_v_dim,
        feature_map=read_feature_activation(f), output_gate=f.flag("use_output_gate"),
        elementwise_affine=f.flag("elementwise_affine"), short_conv=f.flag("use_short_conv"),
        conv_size=f.integer("conv_size"), clamp_min=None if clamp is None else float(clamp),
    )


class FlaShortConv(nn.Module):
    """fla's ShortConvolution at inference: a causal depthwise convolution over the last W inputs, then SiLU.

    Its window is fla's cache layout: the last W inputs [B, D, W], oldest first (zeros before the start); the
    oldest column is dropped before use, so y_t = sum_i w_i x_{t-W+1+i}."""

    def __init__(self, dim: int, size: int) -> None:
        super().__init__()
        self.size = size
        self.weight = nn.Parameter(torch.zeros(dim, 1, size))  # [D, 1, W], fla's name and shape

    def forward(self, x: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        full = torch.cat([window, x.transpose(1, 2)], dim=2)  # [B, D, W + T]
        y = F.conv1d(full[:, :, 1:], self.weight, groups=self.weight.shape[0])  # [B, D, T]
        return F.silu(y).transpose(1, 2), full[:, :, -self.size :]  # [B, T, D], new window [B, D, W]


def log_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """log(sigmoid(x)) without log(0): min(x, 0) - log(1 + exp(-|x|))."""
    return torch.clamp(x, max=0.0) - torch.log1p(torch.exp(-x.abs()))


class FlaGatedAttention(nn.Module):
    """fla's MultiScaleRetention (RetNet) and GatedLinearAttention (GLA) on edgelin's forms, with the ops'
    log-decay g: per head for RetNet (log gamma_h), per key feature for GLA (the gate).

    q (and k) go through the optional activation, RetNet's rotary, then q is scaled by head_k_dim^-0.5; the
    attention has no denominator. The output is a per-head RMSNorm, times swish(g_proj(x)) with the output gate.
    State per layer: S [B, Hs, Dk, Dv] (Hs = num_heads for RetNet, whose decay differs per query head; the key/value
    heads for GLA, whose state is the same for every query head of a group), RetNet's position "pos" [B] int64
    (the rotary offset), GLA's conv windows "conv_q" / "conv_k" / "conv_v" [B, D, W]."""

    def __init__(self, o: GatedOptions, common: Common) -> None:
        super().__init__()
        self.o = o
        self.groups = o.num_heads // o.num_kv_heads
        hidden = common.hidden_size
        key, kv_key, kv_value = o.num_heads * o.head_k_dim, o.num_kv_heads * o.head_k_dim, o.num_kv_heads * o.head_v_dim
        self.q_proj = nn.Linear(hidden, key, bias=False)
        self.k_proj = nn.Linear(hidden, kv_key, bias=False)
        self.v_proj = nn.Linear(hidden, kv_value, bias=False)
        if o.output_gate:
            self.g_proj = nn.Linear(hidden, o.num_heads * o.head_v_dim, bias=False)
        if o.short_conv:
            self.q_conv1d = FlaShortConv(key, o.conv_size)
            self.k_conv1d = FlaShortConv(kv_key, o.conv_size)
            self.v_conv1d = FlaShortConv(kv_value, o.conv_size)
        if o.decay == "gla":
            self.gk_proj = nn.Sequential(nn.Linear(hidden, GLA_GATE_RANK, bias=False), nn.Linear(GLA_GATE_RANK, kv_key, bias=True))
        self.o_proj = nn.Linear(o.num_heads * o.head_v_dim, hidden, bias=False)
        self.g_norm = RMSNorm(o.head_v_dim, common.norm_eps)
        if not o.elementwise_affine:  # fla's norm then has no weight: a fixed 1, not in the checkpoint
            del self.g_norm.weight
            self.g_norm.register_buffer("weight", torch.ones(o.head_v_dim), persistent=False)
        self.act = GATED_FEATURE_MAPS[o.feature_map]
        self.phi = Adjusted(make_feature_map("identity", o.head_k_dim), query_scale=o.head_k_dim**-0.5)
        if o.decay == "fixed":
            # fla's retention kernels: g = log(1 - 2^(-5-h)) for query head h, computed in float32
            gamma = 1 - 2.0 ** (-5.0 - torch.arange(o.num_heads, dtype=torch.float32))
            self.register_buffer("log_gamma", gamma.log(), persistent=False)  # [H]
            inv_freq = 1.0 / (ROTARY_BASE ** (torch.arange(0, o.head_k_dim, 2, dtype=torch.float32) / o.head_k_dim))
            self.register_buffer("inv_freq", inv_freq, persistent=False)  # [Dk / 2]

    @property
    def state_heads(self) -> int:
        return self.o.num_heads if self.o.decay == "fixed" else self.o.num_kv_heads

    def state_layout(self) -> dict[str, tuple]:
        o = self.o
        layout: dict[str, tuple] = {"S": (("batch", self.state_heads, o.head_k_dim, o.head_v_dim), "float32", 0.0)}
        if o.decay == "fixed":
            layout["pos"] = (("batch",), "int64", 0)
        if o.short_conv:
            for name, conv in (("q", self.q_conv1d), ("k", self.k_conv1d), ("v", self.v_conv1d)):
                layout[f"conv_{name}"] = (("batch", conv.weight.shape[0], o.conv_size), "float32", 0.0)
        return layout

    def _rotary(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """fla's rotary (halves, not interleaved) at absolute ``positions`` [B, T]: x [B, h, T, Dk]."""
        angles = positions.to(torch.float32)[..., None] * self.inv_freq  # [B, T, Dk / 2]
        cos, sin = angles.cos()[:, None].to(x.dtype), angles.sin()[:, None].to(x.dtype)  # [B, 1, T, Dk / 2]
        x1, x2 = x.chunk(2, dim=-1)  # [B, h, T, Dk / 2] each
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)  # [B, h, T, Dk]

    def forward(self, x: torch.Tensor, state: State, chunk_size: int | None) -> tuple[torch.Tensor, State]:
        o = self.o
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [B, T, H Dk], [B, T, Hkv Dk], [B, T, Hkv Dv]
        new: State = {}
        if o.short_conv:
            q, new["conv_q"] = self.q_conv1d(q, state["conv_q"])
            k, new["conv_k"] = self.k_conv1d(k, state["conv_k"])
            v, new["conv_v"] = self.v_conv1d(v, state["conv_v"])
        q = split_heads(q, o.num_heads, o.head_k_dim)  # [B, H, T, Dk]
        k = split_heads(k, o.num_kv_heads, o.head_k_dim, self.groups)  # [B, H, T, Dk]
        v = split_heads(v, o.num_kv_heads, o.head_v_dim, self.groups)  # [B, H, T, Dv]
        if self.act is not None:
            q, k = self.act(q), self.act(k)
        if o.decay == "fixed":
            pos = state["pos"]  # [B]
            positions = pos[:, None] + torch.arange(T, device=x.device)[None, :]  # [B, T]
            q, k = self._rotary(q, positions), self._rotary(k, positions)
            new["pos"] = pos + T
            g = self.log_gamma[None, :, None].expand(B, o.num_heads, T)  # [B, H, T]
            S0 = state["S"]  # [B, H, Dk, Dv]
        else:
            gk = log_sigmoid(self.gk_proj(x)) / GLA_GATE_NORMALIZER  # [B, T, Hkv Dk]
            if o.clamp_min is not None:
                gk = torch.clamp(gk, min=o.clamp_min)
            g = split_heads(gk, o.num_kv_heads, o.head_k_dim, self.groups)  # [B, H, T, Dk]
            S0 = share_state({"S": state["S"]}, self.groups)["S"]  # [B, H, Dk, Dv]
        common = dict(feature_map=self.phi, initial_state={"S": S0}, normalize=False, g=g)
        if chunk_size is None:
            y, out = recurrent_step(q, k, v, **common)  # [B, H, 1, Dv]
        else:
            y, out = FORMS["chunk"](q, k, v, chunk_size=chunk_size, **common)  # [B, H, T, Dv]
        new["S"] = out["S"] if o.decay == "fixed" else unshare_state(out, self.groups)["S"]  # [B, Hs, Dk, Dv]
        y = self.g_norm(y).transpose(1, 2).reshape(B, T, o.num_heads * o.head_v_dim)  # [B, T, H Dv]
        if o.output_gate:
            y = y * F.silu(self.g_proj(x))  # [B, T, H Dv]
        return self.o_proj(y), {name: new[name] for name in self.state_layout()}  # [B, T, hidden]


def gated_renames(o: GatedOptions) -> list[tuple[str, str]]:
    # with the output gate and fuse_norm, fla fuses the norm and the gate into one module of another name
    return [(".attn.g_norm_swish_gate.", ".attn.g_norm.")]


GATED_FIELDS = {  # shared by RetNet and GLA (the defaults that differ are set per family)
    "num_kv_heads": None, "feature_map": None, "use_short_conv": False, "conv_size": 4, "use_output_gate": True,
    "elementwise_affine": True,
    "attn_mode": "chunk",  # which fla kernel runs the same math: no effect here
}

FAMILIES["retnet"] = Family(
    name="fla/retnet",
    fields={**GATED_FIELDS, "expand_k": 1.0, "expand_v": 2.0, "num_heads": 8, "hidden_ratio": 2},
    read=read_retnet,
    make_layer=FlaGatedAttention,
    renames=gated_renames,
)

FAMILIES["gla"] = Family(
    name="fla/gla",
    fields={
        **GATED_FIELDS, "expand_k": 0.5, "expand_v": 1.0, "num_heads": 4, "hidden_ratio": 4, "clamp_min": None,
        "use_gk": True, "use_gv": False,
    },
    read=read_gla,
    make_layer=FlaGatedAttention,
    renames=gated_renames,
    chunk_size=32,  # the per-feature decay's intra-chunk tensor is T x C x Dk per head (see edgelin.ops.chunk)
)


def load_retnet(path: str | Path) -> FlaCausalLM:
    return load_fla(path, "retnet")


def load_gla(path: str | Path) -> FlaCausalLM:
    return load_fla(path, "gla")


__all__ = [
    "FAMILIES", "Family", "FlaCausalLM", "FlaGatedAttention", "FlaLinearAttention", "load_fla", "load_gla",
    "load_linear_attn", "load_retnet",
]
