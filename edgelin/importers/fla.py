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
    expected = expected_shapes(lambda: FlaCausalLM(family, source, options, common))
    groups = match(expected, header_shapes(weights), rename, weights)
    model = FlaCausalLM(family, source, options, common)
    load_weights(model, read_safetensors(path), groups, weights)
    return model.eval()


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


def read_linear_attn(f: Fields, common: Common) -> LinearAttnOptions:
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
    fm = f.get("feature_map")
    if fm not in LINEAR_ATTN_MAPS:
        raise f.fail("feature_map", f"is {fm!r}; edgelin supports {', '.join(map(repr, LINEAR_ATTN_MAPS))}")
    return LinearAttnOptions(
        num_heads=heads, num_kv_heads=kv_heads, head_k_dim=dims["expand_k"], head_v_dim=dims["expand_v"],
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
        B, T, _ = x.shape
        x = x.view(B, T, heads, dim).transpose(1, 2)  # [B, heads, T, dim]
        if heads == self.o.num_heads:
            return x
        return x[:, :, None].expand(B, heads, self.groups, T, dim).reshape(B, self.o.num_heads, T, dim)  # [B, H, T, dim]

    def _share(self, state: State) -> State:
        """Per key/value head -> per query head (query head h reads key/value head h // groups)."""
        if self.groups == 1:
            return state
        out = {}
        for name, t in state.items():
            B, Hkv, *rest = t.shape
            out[name] = t[:, :, None].expand(B, Hkv, self.groups, *rest).reshape(B, Hkv * self.groups, *rest)  # [B, H, ...]
        return out

    def _unshare(self, state: State) -> State:
        """Per query head -> per key/value head: the heads of a group built identical states; keep the first."""
        if self.groups == 1:
            return state
        return {name: t[:, :: self.groups] for name, t in state.items()}  # [B, Hkv, ...]

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


__all__ = ["FAMILIES", "Family", "FlaCausalLM", "FlaLinearAttention", "load_fla", "load_linear_attn"]
