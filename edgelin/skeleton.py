"""The one model skeleton every causal LM in edgelin is a configuration of.

    tokens -> embedding -> n x [RMSNorm -> mixer -> + -> RMSNorm -> SwiGLU -> +] -> RMSNorm -> LM head (or tied)

A *mixer* is the token-mixing layer of a block, one of the layer kinds of edgelin.layers (linear attention, softmax
attention with a KV cache, gated and delta-rule linear attention, Mamba2, short convs, an MLP). A kind is a
``torch.nn.Module`` registered by name in ``edgelin.layers.MIXERS`` that owns its math in every form and its part of
the state:

    state_layout() -> {name: (shape with "batch" [and "past"], dtype name, init[, window])}    # its state, in order
    forward(x [B, T, d], state {name: tensor}, *, form, chunk_size, lengths) -> (y [B, T, d], new state)
    forms: tuple[str, ...] | None   # the forms it runs ("chunk" for the prefill graph, "step" for decode, ...);
                                    # None: any form (a layer with no state, whose tokens do not mix)
    accepts_lengths: bool           # forward takes a right-padded ragged batch (``lengths``)
    bounded_state: bool             # its float states stay bounded (a decay, a window, a cache): float16 is safe
    uses_carry: bool                # forward also takes ``carry=``, a dict shared by the layers of one forward call

A block's MLP may have a state too (RWKV's channel mix keeps the previous token): an MLP that declares
``state_layout()`` is called as a mixer is, ``forward(x, state, *, form, chunk_size, lengths) -> (y, new state)``, in
every form, and its state names join the block's prefixed by ``MLP_STATE`` ("ffn."). ``carry`` holds values one layer
hands to later ones within a call (RWKV-7's v_first: layer 0 writes it, the others read it); it is never a state.

``CausalLM`` holds the blocks and implements edgelin's model protocol (edgelin.protocol) once for all of them:
the state contract, fresh states, the per-layer split of a state by structured keys (layer, name), forms,
ragged batches and the prefill chunk. A state key is built from (layer, name) by ``state_key`` and nowhere else.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace
from typing import Any, Callable

import torch
from torch import nn

from edgelin.layers import runs
from edgelin.layers.mlp import SwiGLU
from edgelin.layers.norms import RMSNorm
from edgelin.ops import fused
from edgelin.ops.lengths import check_lengths
from edgelin.protocol import select_positions
from edgelin.runtime.manifest import StateSpec, state_key
from edgelin.state import State, fresh_state

PLACEMENTS = ("pre", "post", "sandwich", "none")
MLP_STATE = "ffn."  # prefix of a stateful MLP's state names within its block's state


class Block(nn.Module):
    """Two sublayers, the mixer then the MLP, each added to the residual stream (``mlp_hidden=None``: no MLP, as
    Mamba2's). ``placement`` says where each sublayer's norms sit (the same for both sublayers of a block):

        "pre"       x + f(norm(x))                 (most families)
        "post"      x + post_norm(f(x))            (OLMo's attention layers)
        "sandwich"  x + post_norm(f(norm(x)))      (LFM3's sandwich norms)
        "none"      x + f(x)                       (a mixer that norms its own input, as Zamba2's hybrid layer)

    The norms are ``attn_norm`` / ``attn_post_norm`` and ``mlp_norm`` / ``mlp_post_norm`` (None where absent).
    ``residual_scale`` multiplies what each branch adds to the residual stream (Granite's residual_multiplier)."""

    def __init__(
        self, mixer: nn.Module, d_model: int, mlp_hidden: int | None, norm_eps: float, norm: type[RMSNorm] = RMSNorm,
        mlp: type[nn.Module] = SwiGLU, residual_scale: float = 1.0, placement: str = "pre",
    ) -> None:
        super().__init__()
        if placement not in PLACEMENTS:
            raise ValueError(f"norm placement {placement!r} is not one of {', '.join(PLACEMENTS)}")
        self.placement = placement
        before, after = placement in ("pre", "sandwich"), placement in ("post", "sandwich")
        self.attn_norm = norm(d_model, norm_eps) if before else None
        self.attn = mixer
        self.attn_post_norm = norm(d_model, norm_eps) if after else None
        self.residual_scale = residual_scale
        self.mlp_norm = self.mlp = self.mlp_post_norm = None
        if mlp_hidden is not None:
            self.mlp_norm = norm(d_model, norm_eps) if before else None
            self.mlp = mlp(SimpleNamespace(d_model=d_model, mlp_hidden=mlp_hidden))
            self.mlp_post_norm = norm(d_model, norm_eps) if after else None

    def _add(self, x: torch.Tensor, h: torch.Tensor, post: nn.Module | None) -> torch.Tensor:
        if post is not None:
            h = post(h)
        return x + (h if self.residual_scale == 1.0 else h * self.residual_scale)

    @property
    def mlp_stateful(self) -> bool:
        """The MLP keeps a state of its own (it declares ``state_layout``)."""
        return self.mlp is not None and hasattr(self.mlp, "state_layout")

    def state_layout(self) -> dict[str, tuple]:
        """The block's state: its mixer's layout, then a stateful MLP's with each name prefixed by ``MLP_STATE``."""
        layout = self.attn.state_layout()
        if self.mlp_stateful:
            layout = {**layout, **{MLP_STATE + name: entry for name, entry in self.mlp.state_layout().items()}}
        return layout

    @property
    def defers_residual(self) -> bool:
        """Its residual adds can ride in the norm after them (the fused lowering's SkipSimplifiedLayerNormalization):
        norms before each sublayer only, that take a residual (``RMSNorm``), and no residual scale."""
        return self.placement == "pre" and self.residual_scale == 1.0 and getattr(self.attn_norm, "takes_residual", False)

    def forward(
        self, x: torch.Tensor, state: State, *, pending: torch.Tensor | None = None, defer: bool = False, **run: Any,
    ) -> tuple[Any, State]:
        """-> (x, state). ``pending`` (only where ``defers_residual``): a branch output not yet added to ``x`` (the
        stream is x + pending; this block's first norm adds it). ``defer``: return ((x, h), state), the last branch's
        output h not added (the next block's norm, or the final one, adds it)."""
        embeddings = run.pop("embeddings", None)
        carry = run.pop("carry", None)
        mlp_run = dict(run)
        if getattr(self.attn, "reads_embeddings", False):  # a mixer fed the model's input embeddings (Zamba2's)
            run["embeddings"] = embeddings
        if getattr(self.attn, "uses_carry", False):  # a mixer that reads or writes the per-call carry (RWKV-7's v_first)
            run["carry"] = carry
        if self.mlp_stateful:
            mlp_state = {name[len(MLP_STATE):]: value for name, value in state.items() if name.startswith(MLP_STATE)}
            state = {name: value for name, value in state.items() if not name.startswith(MLP_STATE)}
        if pending is None:
            normed = x if self.attn_norm is None else self.attn_norm(x)
        else:
            normed, x = self.attn_norm(x, pending)
        h, state = self.attn(normed, state, **run)
        if self.mlp is None:
            return ((x, h) if defer else self._add(x, h, self.attn_post_norm)), state
        if fused.active() and self.defers_residual:  # the add and the norm after it: one node
            h, x = self.mlp_norm(x, h)
        else:
            x = self._add(x, h, self.attn_post_norm)
            h = x if self.mlp_norm is None else self.mlp_norm(x)
        if self.mlp_stateful:
            h, mlp_state = self.mlp(h, mlp_state, **mlp_run)
            state = {**state, **{MLP_STATE + name: value for name, value in mlp_state.items()}}
        else:
            h = self.mlp(h)
        return ((x, h) if defer else self._add(x, h, self.mlp_post_norm)), state


class CausalLM(nn.Module):
    """embedding -> blocks -> final norm -> head, over any mixers; the model protocol for all of them.

    ``make_mixer(layer)``: the mixer of each layer. ``config``: the manifest's "model" field (its "chunk_size", if present, follows ``with_chunk_size``).
    ``norm``: the class of the blocks' and the final norm (``RMSNorm``, or ``UnitOffsetRMSNorm``); ``mlp`` the
    blocks' MLP class (``SwiGLU`` or ``PackedSwiGLU``), or a function of the layer index giving each block's (a class,
    or any function of the block's sizes that builds it: dense layers before mixture-of-experts ones);
    ``embed_scale`` multiplies the embeddings, ``residual_scale`` each branch's output, and the logits are divided
    by ``logits_scale`` (Granite's multipliers; at 1 they add nothing to the graphs). ``placement``: the blocks' norm placement (``Block``), one for all or
    a function of the layer index; ``logits_softcap`` c: logits = c tanh(logits / c) (Gemma's final soft cap).
    A mixer with ``reads_embeddings = True`` is called with ``embeddings=`` the scaled input embeddings [B, T, d].
    ``embed_norm``: a norm (of class ``norm``) on the scaled embeddings before the first block (RWKV's ``pre_norm``);
    the embeddings handed to mixers are then the normed ones."""

    def __init__(
        self, make_mixer: Callable[[int], nn.Module], *, n_layers: int, vocab_size: int, d_model: int, mlp_hidden: int | None,
        norm_eps: float, tie_embeddings: bool, chunk_size: int, config: dict[str, Any], norm: type[RMSNorm] = RMSNorm,
        mlp: type[nn.Module] | Callable[[int], Callable[..., nn.Module]] = SwiGLU, embed_scale: float = 1.0,
        residual_scale: float = 1.0, logits_scale: float = 1.0,
        placement: str | Callable[[int], str] = "pre", logits_softcap: float | None = None, embed_norm: bool = False,
    ) -> None:
        super().__init__()
        self.vocab_size, self.chunk_size, self.config = vocab_size, chunk_size, dict(config)
        self.max_positions: int | None = None  # a context limit the family declares (edgelin.protocol)
        self.embed = nn.Embedding(vocab_size, d_model)
        # the mixers are built in layer order after the embedding, so a seeded build draws the same numbers always
        self.embed_scale, self.logits_scale, self.logits_softcap = embed_scale, logits_scale, logits_softcap
        place = placement if callable(placement) else (lambda i: placement)
        mlp_of = mlp if not isinstance(mlp, type) else (lambda i: mlp)
        self.blocks = nn.ModuleList(
            Block(make_mixer(i), d_model, mlp_hidden, norm_eps, norm, mlp_of(i), residual_scale, place(i)) for i in range(n_layers)
        )
        self.norm = norm(d_model, norm_eps)
        self.embed_norm = norm(d_model, norm_eps) if embed_norm else None
        self.lm_head = None if tie_embeddings else nn.Linear(d_model, vocab_size, bias=False)

    # ---- the model protocol (edgelin.protocol) ------------------------------------------------------------
    accepts_logits_at = True  # forward(..., logits_at=) runs the head at the asked positions only

    @property
    def accepts_lengths(self) -> bool:
        """forward(..., lengths=) prefills a right-padded ragged batch when every mixer can."""
        return all(
            getattr(b.attn, "accepts_lengths", False) and (not b.mlp_stateful or getattr(b.mlp, "accepts_lengths", False))
            for b in self.blocks
        )

    @property
    def state_decays(self) -> bool:
        """Every float state stays bounded (decays, or is a cache of bounded values): float16 states are safe."""
        return all(
            getattr(b.attn, "bounded_state", False) and (not b.mlp_stateful or getattr(b.mlp, "bounded_state", False))
            for b in self.blocks
        )

    def model_config(self) -> dict[str, Any]:
        config = dict(self.config)
        if "chunk_size" in config:
            config["chunk_size"] = self.chunk_size
        return config

    def layer_keys(self) -> list[dict[str, str]]:
        """Per layer, state name -> state key, in the layer's layout order: built from (layer, name) here only."""
        return [{name: state_key(i, name) for name in block.state_layout()} for i, block in enumerate(self.blocks)]

    def state_specs(self) -> tuple[StateSpec, ...]:
        """The state contract, in graph order: each layer's mixer state, in the mixer's layout order (then a stateful
        MLP's, ``Block.state_layout``)."""
        return tuple(
            StateSpec.for_key(state_key(i, name), *entry)  # (shape, dtype, init[, window])
            for i, block in enumerate(self.blocks)
            for name, entry in block.state_layout().items()
        )

    def init_state(self, batch: int) -> State:
        """Every state tensor at its init value; float tensors in the model's dtype."""
        p = self.embed.weight
        return fresh_state(self.state_specs(), batch, dtype=p.dtype, device=p.device)

    @property
    def forms(self) -> tuple[str, ...]:
        """The forms every mixer runs."""
        kinds = [set(forms) for b in self.blocks if (forms := getattr(b.attn, "forms", ("chunk", "step"))) is not None]
        common = set.intersection(*kinds) if kinds else {"chunk", "step"}
        return tuple(sorted(common))

    # ---- running ----------------------------------------------------------------------------------------
    def _logits(self, x: torch.Tensor, at: torch.Tensor | None = None, pending: torch.Tensor | None = None) -> torch.Tensor:
        # the final norm on every row, the head on the asked ones (at [B, P]): a norm is ~D flops a row against the
        # head's D x V, and on every row it stays one node with the last residual add (ONNX Runtime fuses the two)
        x = self.norm(x) if pending is None else self.norm(x, pending)[0]  # pending: the last block's output, not yet added
        if at is not None:
            x = select_positions(x, at)
        logits = x @ self.embed.weight.T if self.lm_head is None else self.lm_head(x)  # [B, T, vocab]
        if self.logits_scale != 1.0:
            logits = logits / self.logits_scale
        if self.logits_softcap is not None:
            logits = torch.tanh(logits / self.logits_softcap) * self.logits_softcap
        return logits

    def forward(
        self, input_ids: torch.Tensor, state: State | None = None, *, form: str = "chunk", lengths: torch.Tensor | None = None,
        logits_at: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, State]:
        """input_ids [B, T] -> logits [B, T, vocab], state after the last token. ``form``: the form of every
        mixer ("chunk": the prefill graph; "step" takes T = 1 and is what ``step`` runs; a mixer may run more).

        ``lengths`` [B] int64 (a ragged batch, right padding; sequence forms only): row b's real tokens are
        its first lengths[b]; its returned state is that after its last real token, exactly as prefilling
        the row alone, and its logits at t >= lengths[b] mean nothing (edgelin.ops.lengths).

        ``logits_at`` [B, P] int64: the logits of those positions only, [B, P, vocab] (``select_positions``); the
        head runs on P rows instead of T (a prompt needs the last one)."""
        if form not in self.forms:
            layer = next(i for i, b in enumerate(self.blocks) if not runs(b.attn, form))
            mixer = self.blocks[layer].attn
            raise ValueError(
                f"layer {layer} ({mixer.kind}{getattr(mixer, 'variant', '')}) runs the forms {', '.join(mixer.forms)}, not {form!r}"
            )
        if lengths is not None:
            if form in ("step", "recurrent"):
                raise ValueError(f"the {form} form takes no lengths (ragged batches run in the naive, chunk and parallel forms)")
            if not self.accepts_lengths:
                kinds = sorted({b.attn.kind for b in self.blocks if not getattr(b.attn, "accepts_lengths", False)})
                raise ValueError(f"a ragged batch (lengths) needs every layer to take lengths; {', '.join(kinds)} layers do not")
            lengths = check_lengths(lengths, tuple(input_ids.shape))
        if state is None:
            state = self.init_state(input_ids.shape[0])
        x = self.embed(input_ids)  # [B, T, d_model]
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        new_state: State = {}
        run = {"form": form, "chunk_size": self.chunk_size, "lengths": lengths, "embeddings": x, "carry": {}}
        if self._defers_residual():  # each block's last add rides in the next norm (one fused node each)
            pending = None
            for block, keys in zip(self.blocks, self.layer_keys()):
                layer_state = {name: state[key] for name, key in keys.items()}
                (x, pending), layer = block(x, layer_state, pending=pending, defer=True, **run)
                new_state.update({key: layer[name] for name, key in keys.items()})
            return self._logits(x, logits_at, pending), new_state
        for block, keys in zip(self.blocks, self.layer_keys()):
            x, layer = block(x, {name: state[key] for name, key in keys.items()}, **run)
            new_state.update({key: layer[name] for name, key in keys.items()})
        return self._logits(x, logits_at), new_state

    def _defers_residual(self) -> bool:
        """Under the fused lowering, when every block and the final norm can take a pending residual
        (``Block.defers_residual``)."""
        return fused.active() and all(b.defers_residual for b in self.blocks) and getattr(self.norm, "takes_residual", False)

    def step(self, input_ids: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        """One token per sequence: input_ids [B, 1] -> logits [B, 1, vocab], the next state."""
        return self.forward(input_ids, state, form="step")

    def with_chunk_size(self, chunk_size: int) -> "CausalLM":
        """This model with another prefill chunk length (the chunk changes no result, only speed): a new model object
        that shares every layer and weight with this one (none copied: a model mapped from disk stays mapped)."""
        if chunk_size == self.chunk_size:
            return self
        model = copy.copy(self)
        model.chunk_size = chunk_size
        return model

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def init_weights(model: nn.Module) -> None:
    """GPT-2 style: N(0, 0.02) for every linear and embedding weight, then the residual projections
    (attn.o_proj, mlp.down) of each block scaled by 1/sqrt(2 n_layers). Shared by LinearLM and SoftmaxLM."""

    def normal(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    model.apply(normal)
    for block in model.blocks:
        for proj in (block.attn.o_proj, block.mlp.down):
            nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * len(model.blocks)))


__all__ = ["MLP_STATE", "PLACEMENTS", "Block", "CausalLM", "init_weights"]
