"""edgelin's import of Hugging Face transformers Nemotron-H checkpoints with "moe" (E) layers (``nemotron_h``) against
transformers' own model.

Oracle: hf_oracle.py (transformers 5.x's NemotronHForCausalLM in a subprocess, fp32: its grouped matmul takes no
float64), with testkit/oracles/nemotron_h_moe.py's perturbation: routers with clear margins and a non-zero
score-correction bias. A "moe" layer is a mixer of its own (no state): sigmoid router scores, the choice with the
bias (group-limited where n_group > 1), relu^2 experts without a gate (inside latent projections where
moe_latent_size is set) and one relu^2 shared expert; a 150-token prefill then 20 cached decode steps, batch 2.
Budget, fp32: max abs logits error <= 1e-4; the cache (SSM states, conv windows, keys, values) is compared too.
"""

from __future__ import annotations

import pytest
import torch

from edgelin.checkpoint import load_checkpoint
from edgelin.layers.moe import MoE, MoEMixer
from edgelin.ops.moe import group_limit
from testkit import hf_oracle
from testkit import rel_l2 as rel  # |got - ref|_2 / |ref|_2
from testkit.experts import moe_export_matches
from testkit.stateful import (edited_copy, import_vs_reference, pieces_and_steps_agree,
                               protocol_and_naive_agree)

pytest.importorskip("transformers", reason="transformers is not installed; pip install -e '.[test]'")

MAX_ABS = 1e-4
STATE_REL = 1e-5
BATCH, PROMPT, STEPS = 2, 150, 20
NEMOTRON = {
    "vocab_size": 97, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "intermediate_size": 40,
    "mamba_num_heads": 8, "mamba_head_dim": 6, "ssm_state_size": 8, "n_groups": 2, "conv_kernel": 3, "time_step_min": 1e-5,
    "moe_intermediate_size": 24, "moe_shared_expert_intermediate_size": 20,
}
CASES = {
    # Mamba2, MoE, attention, MoE; 8 experts in 4 groups, the best 2 groups kept, top 2, latent width 16, renormalised,
    # scaled by 2.5
    "nemotron-moe-groups-latent": {**NEMOTRON, "hybrid_override_pattern": "ME*E", "n_routed_experts": 8, "num_experts_per_tok": 2,
                                   "n_group": 4, "topk_group": 2, "moe_latent_size": 16, "routed_scaling_factor": 2.5},
    # MoE, MLP, attention; 6 experts top 3 in one group, no latent projection, not renormalised (an attention layer: without
    # one transformers' cache cannot count positions)
    "nemotron-moe-plain": {**NEMOTRON, "hybrid_override_pattern": "E-*", "n_routed_experts": 6, "num_experts_per_tok": 3,
                           "norm_topk_prob": False},
}
_RESULTS: dict[str, tuple] = {}


def oracle(case_id: str, tmp_path_factory):
    """(checkpoint folder, prompt, steps, transformers' outputs) for one case, once per session."""
    return hf_oracle.cached(_RESULTS, case_id, "nemotron_h_moe", CASES[case_id], tmp_path_factory, batch=BATCH, prompt=PROMPT,
                            steps=STEPS, vocab=NEMOTRON["vocab_size"])


@pytest.mark.parametrize("case_id", list(CASES))
def test_import_matches_transformers(case_id, tmp_path_factory):
    folder, prompt, steps, ref = oracle(case_id, tmp_path_factory)
    model, state = import_vs_reference(folder, prompt, steps, ref["prefill"], ref["decode"], MAX_ABS, against="transformers")
    cfg = CASES[case_id]
    for i, block in enumerate(model.blocks):
        assert block.mlp is None
        if block.attn.kind == "attention":
            assert rel(state[f"{i}.key"], ref[f"{i}.key"]) <= STATE_REL
            assert rel(state[f"{i}.value"], ref[f"{i}.value"]) <= STATE_REL
        elif block.attn.kind == "mamba2":
            S = ref[f"{i}.recurrent"].transpose(-1, -2)  # transformers: [B, H, P, N]; edgelin: [B, H, N, P]
            assert rel(state[f"{i}.S"], S) <= STATE_REL and rel(state[f"{i}.conv"], ref[f"{i}.conv"]) <= STATE_REL
        else:  # "moe" and "mlp" layers: no state, no cache in transformers either
            assert not any(key.startswith(f"{i}.") for key in state) and f"{i}.key" not in ref
        if cfg["hybrid_override_pattern"][i] != "E":
            continue
        assert isinstance(block.attn, MoEMixer)
        moe = block.attn.mlp
        o = moe.options
        assert (o.num_experts, o.top_k, o.scoring, o.expert_kind, o.shared_kind) == (
            cfg["n_routed_experts"], cfg["num_experts_per_tok"], "sigmoid", "relu2", "relu2")
        assert (o.renormalise, o.scaling, o.latent, o.groups, o.top_groups) == (
            cfg.get("norm_topk_prob", True), cfg.get("routed_scaling_factor", 1.0), cfg.get("moe_latent_size"),
            cfg.get("n_group", 1), cfg.get("topk_group", 1))
        assert moe.expert_bias.abs().max() > 0.05  # the perturbed bias was read


def test_routing_margins_are_clear(tmp_path_factory):
    """The oracle's routers leave no near tie (a flip within float32 rounding would make the comparisons above depend on
    luck): the k-th and (k+1)-th choice scores among the kept groups, and the kept and the best dropped group's scores,
    differ by more than 1e-4 everywhere."""
    folder, prompt, *_ = oracle("nemotron-moe-groups-latent", tmp_path_factory)
    model = load_checkpoint(folder)
    gaps = []

    def gap(mod, args):
        o = mod.options
        choice = torch.sigmoid(mod.router(args[0])).reshape(-1, o.num_experts) + mod.expert_bias
        top = group_limit(choice, o.groups, o.top_groups).topk(o.top_k + 1, dim=-1).values
        gaps.append((top[:, -2] - top[:, -1]).min())
        groups = choice.reshape(-1, o.groups, o.num_experts // o.groups).topk(2, dim=-1).values.sum(-1)
        best = groups.topk(o.top_groups + 1, dim=-1).values
        gaps.append((best[:, -2] - best[:, -1]).min())

    hooks = [m.register_forward_pre_hook(gap) for m in model.modules() if isinstance(m, MoE)]
    with torch.no_grad():
        model(prompt)
    for h in hooks:
        h.remove()
    assert len(gaps) == 4 and min(gaps) > 1e-4, gaps


def test_protocol_forms_and_pieces(tmp_path_factory):
    """The protocol; the naive forms against the chunk form in float64; prefill in pieces of 1, chunk - 1 and
    chunk + 1 from a carried state, and token by token, against one prefill."""
    folder, *_ = oracle("nemotron-moe-groups-latent", tmp_path_factory)
    model = load_checkpoint(folder)
    chunk = model.chunk_size
    ids = torch.randint(0, 97, (2, 2 * chunk + 1), generator=torch.Generator().manual_seed(1))
    protocol_and_naive_agree(model, "hf/nemotron_h", ids)
    pieces_and_steps_agree(model, ids, (1, chunk - 1, chunk + 1))


@pytest.mark.slow  # an export of a 4-layer MoE hybrid, validate against transformers
def test_export_matches_transformers(tmp_path_factory, tmp_path):
    """Both graphs against transformers; validate passes, transformers (its eager expert loop) and the routing
    agreement included; the JavaScript runtime in node. Each expert's MatMuls run on the rows routed to it only: one
    NonZero and one ScatterND per expert per MoE layer in both graphs; one TopK per MoE layer (the groups are ranked
    by comparisons)."""
    folder, prompt, steps, ref = oracle("nemotron-moe-groups-latent", tmp_path_factory)
    out = tmp_path_factory.mktemp("nemotron-moe-export") / "export"
    moe_export_matches(folder, prompt, steps, ref, out, tmp_path, MAX_ABS, moe_layers=2,
                       experts=CASES["nemotron-moe-groups-latent"]["n_routed_experts"])


@pytest.mark.parametrize("changes, field, fragment", [
    ({"n_group": 3}, "n_group", "must divide n_routed_experts (8)"),
    ({"n_group": 8, "topk_group": 2}, "n_group", "groups of at least 2 experts"),
    ({"topk_group": 5}, "topk_group", "at most n_group (4)"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok", "at most the experts of topk_group groups (4)"),
    ({"routed_scaling_factor": "2"}, "routed_scaling_factor", "must be a number"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob", "true or false"),
    ({"moe_latent_size": 0}, "moe_latent_size", "positive integer or null"),
    ({"mlp_bias": True}, "mlp_bias", "false only"),
])
def test_unsupported_options_are_refused_by_name(changes, field, fragment, tmp_path_factory, tmp_path, refused):
    folder, *_ = oracle("nemotron-moe-groups-latent", tmp_path_factory)
    refused(edited_copy(folder, tmp_path / "ckpt", **changes), repr(field), fragment)


def test_weights_that_disagree_with_the_config_name_the_tensor(tmp_path_factory, tmp_path, refused):
    folder, *_ = oracle("nemotron-moe-groups-latent", tmp_path_factory)
    refused(edited_copy(folder, tmp_path / "ckpt", moe_intermediate_size=16), "backbone.layers.1.mixer.experts.0.",
            "the config expects")
    refused(edited_copy(folder, tmp_path / "ckpt1", moe_latent_size=None), "backbone.layers.1.mixer.fc1_latent_proj.weight",
            "does not describe")
    refused(edited_copy(folder, tmp_path / "ckpt2", n_routed_experts=4, n_group=2, topk_group=1), "backbone.layers.1.mixer.",
            "does not describe")


def test_experts_in_transformers_in_memory_layout_load_the_same(tmp_path_factory, tmp_path):
    """Experts stacked as transformers holds them (mixer.experts.up_proj [E, I, d'], down_proj [E, d', I]) import as
    the per-expert tensors save_pretrained writes: the same model."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    folder, prompt, *_ = oracle("nemotron-moe-plain", tmp_path_factory)
    kept, experts = {}, {}
    for name, t in load_file(folder / "model.safetensors").items():
        m = re.fullmatch(r"(.*\.mixer\.experts\.)(\d+)\.(up_proj|down_proj)\.weight", name)
        if m is None:
            kept[name] = t
        else:
            experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = t
    for (prefix, part), tensors in experts.items():
        kept[prefix + part] = torch.stack([tensors[e] for e in range(len(tensors))])
    assert len(experts) == 2
    (tmp_path / "mem").mkdir()
    save_file(kept, tmp_path / "mem" / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(folder / "config.json", tmp_path / "mem" / "config.json")
    with torch.no_grad():
        assert torch.equal(load_checkpoint(tmp_path / "mem")(prompt[:, :30])[0], load_checkpoint(folder)(prompt[:, :30])[0])


def test_released_config_fields_are_accepted(tmp_path_factory, tmp_path):
    """Nemotron 3 Nano's released config.json carries ``rope_theta``, ``partial_rotary_factor`` and ``norm_eps``, which
    no module of transformers' NemotronH reads (no RoPE; the norms read layer_norm_epsilon): the same model."""
    folder, prompt, *_ = oracle("nemotron-moe-plain", tmp_path_factory)
    released = edited_copy(folder, tmp_path / "ckpt", rope_theta=10000, partial_rotary_factor=1.0, norm_eps=1e-3)
    with torch.no_grad():
        assert torch.equal(load_checkpoint(released)(prompt[:, :30])[0], load_checkpoint(folder)(prompt[:, :30])[0])
