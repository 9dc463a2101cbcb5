"""ModelConfig: a flat, frozen description of a LinearLM, with a JSON round trip.

Torch-free, so the runtime and the CLI can read configs without importing torch.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgelin.errors import ConfigError
from edgelin.runtime.options import check_int, check_number

FEATURE_MAPS = ("identity", "elu+1", "relu", "softplus", "performer", "cosformer")
NORMALISATIONS = ("denominator", "none")
# How each layer's state forgets (S_t = exp(g_t) * S_{t-1} + phi(k_t) v_t^T; see edgelin.layers.linear_attention.DECAYS):
# "none": never (a plain sum); "fixed": RetNet's per-head gamma_h = 1 - 2^(-5-h), no parameters;
# "scalar": data-dependent per head and token (Mamba2); "gla": data-dependent per feature (GLA).
DECAYS = ("none", "fixed", "scalar", "gla")
# How each layer writes its state: "additive" (S += phi(k) v^T, optionally decayed); "delta" (the delta rule,
# DeltaNet, edgelin.ops.delta: S = alpha (I - beta k k^T) S + beta k v^T with k = l2norm(phi(k)), beta =
# sigmoid(W_beta x) per head and token; with decay "fixed" or "scalar", alpha = exp(g): Gated DeltaNet).
UPDATES = ("additive", "delta")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256  # byte-level by default
    d_model: int = 256  # residual stream width
    n_layers: int = 4
    n_heads: int = 4
    head_dim: int = 64  # per-head width of q, k and v
    feature_map: str = "elu+1"  # one of FEATURE_MAPS: phi in sim(q, k) = phi(q)^T phi(k)
    mlp_ratio: float = 4.0  # SwiGLU hidden width = round(mlp_ratio * d_model * 2/3) to a multiple of 8
    chunk_size: int = 64  # chunk length of the parallel (prefill) form
    eps: float = 1e-6  # epsilon of the attention denominator phi(q)^T z
    # "denominator": y = phi(q)^T S / (phi(q)^T z + eps), as in the original linear transformer.
    # "none": y = RMSNorm_head(phi(q)^T S) -- no running normaliser z; the per-head output norm keeps the
    # scale in check (TransNormer/RetNet style). Needed for signed feature maps such as identity.
    normalisation: str = "denominator"
    norm_eps: float = 1e-5  # RMSNorm epsilon
    tie_embeddings: bool = True  # share the token embedding with the LM head
    feature_seed: int = 0  # seed of random features (performer); layer i uses feature_seed + i
    n_features: int = 0  # performer: number of random features (0 = head_dim)
    # A causal depthwise convolution over the last conv_size tokens of each attention input (0 = off).
    # Linear attention alone has no notion of order (the past is a sum); this short conv gives each
    # layer local token order, as in GLA, Mamba and RWKV. Its window is part of the recurrent state.
    conv_size: int = 0
    cosformer_horizon: int = 16384  # cosformer: M in cos(pi/2 * (i - j) / M); distances above M are down-weighted to <= 0
    # A decay of the state (one of DECAYS). It adds no state: the decay is a constant or is computed
    # from the token, so the state contract and the graphs' inputs and outputs stay the same.
    decay: str = "none"
    gate_rank: int = 16  # decay "gla": width r of the low-rank gate projection d_model -> r -> n_heads * F
    # The state update (one of UPDATES). "delta" needs normalisation "none", a per-head decay (or none) and a
    # feature map without positions; its state is S alone, the same contract as "additive" without z.
    update: str = "additive"
    # Hybrid stacks (edgelin.layers.attention): the layers (0-based) that are softmax attention with a KV cache instead of
    # linear attention; n_heads x head_dim query heads, attn_kv_heads key/value heads (0 = n_heads; must divide
    # n_heads), RoPE with base rope_theta over the whole head, a sliding window of attn_window positions (0 = the
    # whole context) and a context limit of max_positions tokens (0 = none declared). With no attention layer these
    # fields are left out of the config's JSON, so a pure-linear model's config (and export) does not change.
    attn_layers: tuple = ()
    attn_kv_heads: int = 0
    attn_window: int = 0
    rope_theta: float = 10000.0
    max_positions: int = 0

    ATTENTION_FIELDS = ("attn_layers", "attn_kv_heads", "attn_window", "rope_theta", "max_positions")

    def __post_init__(self) -> None:
        positive_ints = ("vocab_size", "d_model", "n_layers", "n_heads", "head_dim", "chunk_size", "cosformer_horizon", "gate_rank")
        for name in positive_ints:
            check_int(f"config field {name!r}", getattr(self, name), low=1, error=ConfigError)
        check_int("config field 'n_features'", self.n_features, low=0, hint="0 = head_dim", error=ConfigError)
        if check_int("config field 'conv_size'", self.conv_size, low=0, hint="0 = off, else >= 2", error=ConfigError) == 1:
            raise ConfigError("config field 'conv_size' must be 0 (off) or an integer >= 2, got 1")
        if self.feature_map not in FEATURE_MAPS:
            raise ConfigError(
                f"config field 'feature_map' is {self.feature_map!r}; allowed values: {', '.join(FEATURE_MAPS)}"
            )
        if self.normalisation not in NORMALISATIONS:
            raise ConfigError(
                f"config field 'normalisation' is {self.normalisation!r}; allowed values: {', '.join(NORMALISATIONS)}"
            )
        if self.decay not in DECAYS:
            raise ConfigError(f"config field 'decay' is {self.decay!r}; allowed values: {', '.join(DECAYS)}")
        if self.update not in UPDATES:
            raise ConfigError(f"config field 'update' is {self.update!r}; allowed values: {', '.join(UPDATES)}")
        if self.update == "delta":
            if self.normalisation != "none":
                raise ConfigError("config field 'normalisation' must be 'none' with update 'delta' (the delta rule has no denominator)")
            if self.decay == "gla":
                raise ConfigError("config field 'decay' is 'gla' (per feature); update 'delta' takes 'none', 'fixed' or 'scalar' (per head)")
            if self.feature_map == "cosformer":
                raise ConfigError("config field 'feature_map' is 'cosformer' (it needs positions); update 'delta' takes a map without positions")
        for name in ("mlp_ratio", "eps", "norm_eps"):
            check_number(f"config field {name!r}", getattr(self, name), low=0, open_low=True, error=ConfigError)
        if not isinstance(self.tie_embeddings, bool):
            raise ConfigError(f"config field 'tie_embeddings' must be true or false, got {self.tie_embeddings!r}")
        self._check_attention()
        # layer i seeds its generator with feature_seed + i; torch takes seeds in [-2**63, 2**64 - 1]
        check_int("config field 'feature_seed'", self.feature_seed, low=-(2**63), high=2**64 - self.n_layers, error=ConfigError)

    def _check_attention(self) -> None:
        layers = self.attn_layers
        if not isinstance(layers, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
            raise ConfigError(f"config field 'attn_layers' must be a list of layer indices, got {layers!r}")
        if any(not 0 <= i < self.n_layers for i in layers) or len(set(layers)) != len(layers):
            raise ConfigError(f"config field 'attn_layers' must list distinct layers in [0, {self.n_layers}), got {list(layers)}")
        object.__setattr__(self, "attn_layers", tuple(sorted(layers)))
        kv = check_int("config field 'attn_kv_heads'", self.attn_kv_heads, low=0, hint="0 = n_heads", error=ConfigError)
        if kv and self.n_heads % kv:
            raise ConfigError(f"config field 'attn_kv_heads' ({kv}) must divide n_heads ({self.n_heads})")
        check_int("config field 'attn_window'", self.attn_window, low=0, hint="0 = the whole context", error=ConfigError)
        check_int("config field 'max_positions'", self.max_positions, low=0, hint="0 = none declared", error=ConfigError)
        check_number("config field 'rope_theta'", self.rope_theta, low=0, open_low=True, error=ConfigError)
        if self.head_dim % 2 and layers:
            raise ConfigError(f"config field 'head_dim' ({self.head_dim}) must be even for RoPE in the attention layers")
        if self.attn_window and self.max_positions and self.attn_window > self.max_positions:
            raise ConfigError(
                f"config field 'attn_window' ({self.attn_window}) is larger than max_positions ({self.max_positions}); "
                "a window cannot exceed the context limit"
            )

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def mlp_hidden(self) -> int:
        return max(8, int(round(self.mlp_ratio * self.d_model * 2 / 3 / 8)) * 8)

    @property
    def feature_dim(self) -> int:
        """Width F of phi(x): the state S is [B, H, F, head_dim]."""
        if self.feature_map == "performer":
            return self.n_features or self.head_dim
        if self.feature_map == "cosformer":
            return 2 * self.head_dim  # cos and sin halves
        return self.head_dim

    def kv_cache_bytes(self, tokens: int, batch: int = 1, bytes_per_value: int = 4) -> int:
        """What a softmax-attention model of this size keeps for ``tokens`` positions: K and V of every
        layer and head (2 * layers * heads * tokens * head_dim values per sequence)."""
        return 2 * self.n_layers * self.n_heads * tokens * self.head_dim * bytes_per_value * batch

    # ---- JSON ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if not self.attn_layers:  # a pure-linear model: the attention fields say nothing
            for name in self.ATTENTION_FIELDS:
                del data[name]
        else:
            data["attn_layers"] = list(self.attn_layers)
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        if not isinstance(data, dict):
            raise ConfigError(f"a model config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config field(s) {', '.join(unknown)}; known fields: {', '.join(sorted(known))}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config is not valid JSON: {exc}") from None
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config {path} is not UTF-8 text") from None
        try:
            return cls.from_json(text)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


__all__ = ["ModelConfig", "DECAYS", "FEATURE_MAPS", "NORMALISATIONS", "UPDATES"]
