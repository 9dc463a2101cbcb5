"""edgelin's import of Hugging Face transformers Granite-4.0-H checkpoints with experts (``granitemoehybrid``,
num_local_experts > 0) against transformers' own model.

Oracle: hf_oracle.py (transformers 5.x's GraniteMoeHybridForCausalLM in a subprocess, fp32: its grouped matmul takes no
float64), with testkit/oracles/granitemoehybrid_moe.py's perturbation: routers with clear margins. Every block's MLP
is the mixture of experts (top-k of the router logits, softmax over the chosen) plus ``shared_mlp`` as an always-on
shared expert, the experts stored stacked (input_linear [E, 2I, d], output_linear [E, d, I]); a 150-token prefill then
20 cached decode steps, batch 2. Budget, fp32: max abs logits error <= 1e-4; the cache (SSM states, conv windows, keys,
values) is compared too.
"""

from __future__ import annotations

import pytest
import torch

from edgelin.checkpoint import load_checkpoint
from edgelin.layers.mlp import PackedSwiGLU
from edgelin.layers.moe import MoE
from testkit import hf_oracle
from testkit import rel_l2 as rel  # |got - ref|_2 / |ref|_2
from testkit.experts import moe_export_matches
from testkit.stateful import (edited_copy, import_vs_reference, pieces_and_steps_agree,
                               protocol_and_naive_agree)

pytest.importorskip("transformers", reason="transformers is not installed; pip install -e '.[test]'")

MAX_ABS = 1e-4
STATE_REL = 1e-5
BATCH, PROMPT, STEPS = 2, 150, 20
GRANITE = {
    "vocab_size": 97, "hidden_size": 32, "shared_intermediate_size": 40, "intermediate_size": 24, "num_attention_heads": 4,
    "num_key_value_heads": 2, "mamba_n_heads": 8, "mamba_n_groups": 2, "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2,
}
CASES = {
    # Mamba2, attention (RoPE), Mamba2; 4 experts, top 2; every multiplier away from 1
    "granite-moe-rope": {**GRANITE, "num_hidden_layers": 3, "layer_types": ["mamba", "attention", "mamba"],
                         "num_local_experts": 4, "num_experts_per_tok": 2, "position_embedding_type": "rope",
                         "embedding_multiplier": 3.0, "residual_multiplier": 0.5, "logits_scaling": 1.25, "attention_multiplier": 0.2},
    # attention (no position encoding), Mamba2; 3 experts, top 1 (its weight softmax of one logit: 1); tied
    "granite-moe-k1-tied": {**GRANITE, "num_hidden_layers": 2, "layer_types": ["attention", "mamba"], "num_local_experts": 3,
                            "num_experts_per_tok": 1, "tie_word_embeddings": True},
}
_RESULTS: dict[str, tuple] = {}


def oracle(case_id: str, tmp_path_factory):
    """(checkpoint folder, prompt, steps, transformers' outputs) for one case, once per session."""
    return hf_oracle.cached(_RESULTS, case_id, "granitemoehybrid_moe", CASES[case_id], tmp_path_factory, batch=BATCH,
                            prompt=PROMPT, steps=STEPS, vocab=GRANITE["vocab_size"])


@pytest.mark.parametrize("case_id", list(CASES))
def test_import_matches_transformers(case_id, tmp_path_factory):
    folder, prompt, steps, ref = oracle(case_id, tmp_path_factory)
    model, state = import_vs_reference(folder, prompt, steps, ref["prefill"], ref["decode"], MAX_ABS, against="transformers")
    cfg = CASES[case_id]
    for i, block in enumerate(model.blocks):
        if block.attn.kind == "attention":
            assert rel(state[f"{i}.key"], ref[f"{i}.key"]) <= STATE_REL
            assert rel(state[f"{i}.value"], ref[f"{i}.value"]) <= STATE_REL
        else:
            S = ref[f"{i}.recurrent"].transpose(-1, -2)  # transformers: [B, H, P, N]; edgelin: [B, H, N, P]
            assert rel(state[f"{i}.S"], S) <= STATE_REL and rel(state[f"{i}.conv"], ref[f"{i}.conv"]) <= STATE_REL
        o = block.mlp.options
        assert type(block.mlp) is MoE and type(block.mlp.shared) is PackedSwiGLU and block.mlp.shared_gate is None
        assert (o.num_experts, o.top_k, o.scoring, o.expert_hidden) == (cfg["num_local_experts"], cfg["num_experts_per_tok"],
                                                                       "topk_softmax", cfg["intermediate_size"])


def test_routing_margins_are_clear(tmp_path_factory):
    """The oracle's routers leave no near tie at the top-k boundary (a flip within float32 rounding would make the
    comparisons above depend on luck): the k-th and (k+1)-th router logits differ by more than 1e-4 everywhere."""
    folder, prompt, *_ = oracle("granite-moe-rope", tmp_path_factory)
    model = load_checkpoint(folder)
    gaps = []

    def gap(mod, args):
        top = mod.router(args[0]).reshape(-1, mod.options.num_experts).topk(mod.options.top_k + 1, dim=-1).values
        gaps.append((top[:, -2] - top[:, -1]).min())

    hooks = [block.mlp.register_forward_pre_hook(gap) for block in model.blocks]
    with torch.no_grad():
        model(prompt)
    for h in hooks:
        h.remove()
    assert len(gaps) == 3 and min(gaps) > 1e-4, gaps


def test_protocol_forms_and_pieces(tmp_path_factory):
    """The protocol; the naive forms against the chunk form in float64; prefill in pieces of 1, chunk - 1 and
    chunk + 1 from a carried state, and token by token, against one prefill."""
    folder, *_ = oracle("granite-moe-k1-tied", tmp_path_factory)
    model = load_checkpoint(folder)
    chunk = model.chunk_size
    ids = torch.randint(0, 97, (2, 2 * chunk + 1), generator=torch.Generator().manual_seed(1))
    protocol_and_naive_agree(model, "hf/granitemoehybrid", ids)
    pieces_and_steps_agree(model, ids, (1, chunk - 1, chunk + 1))


@pytest.mark.slow  # an export of a 3-layer MoE hybrid, validate against transformers
def test_export_matches_transformers(tmp_path_factory, tmp_path):
    """Both graphs against transformers; validate passes, transformers (its eager expert loop) and the routing
    agreement included; the JavaScript runtime in node. Each expert's MatMuls run on the rows routed to it only: one
    NonZero and one ScatterND per expert per MoE layer in both graphs, one TopK per layer."""
    folder, prompt, steps, ref = oracle("granite-moe-rope", tmp_path_factory)
    out = tmp_path_factory.mktemp("granite-moe-export") / "export"
    moe_export_matches(folder, prompt, steps, ref, out, tmp_path, MAX_ABS, moe_layers=3,
                       experts=CASES["granite-moe-rope"]["num_local_experts"])


@pytest.mark.parametrize("changes, field, fragment", [
    ({"num_local_experts": None}, "num_local_experts", "must be 0 (dense MLPs) or a positive number of experts"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok", "from 1 to num_local_experts (4)"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok", "from 1 to num_local_experts (4)"),
    ({"intermediate_size": 0}, "intermediate_size", "positive integer"),
    ({"hidden_act": "gelu"}, "hidden_act", "'silu'"),
    ({"output_router_logits": "yes"}, "output_router_logits", "true or false"),
])
def test_unsupported_options_are_refused_by_name(changes, field, fragment, tmp_path_factory, tmp_path, refused):
    folder, *_ = oracle("granite-moe-rope", tmp_path_factory)
    refused(edited_copy(folder, tmp_path / "ckpt", **changes), repr(field), fragment)


def test_weights_that_disagree_with_the_config_name_the_tensor(tmp_path_factory, tmp_path, refused):
    folder, *_ = oracle("granite-moe-rope", tmp_path_factory)
    refused(edited_copy(folder, tmp_path / "ckpt", num_local_experts=5), "model.layers.0.block_sparse_moe.input_linear.weight",
            "[5 experts")
    # an expert's rows of the stacked tensor, named by it and the expert
    refused(edited_copy(folder, tmp_path / "ckpt2", intermediate_size=16),
            "model.layers.0.block_sparse_moe.input_linear.0.gate.weight", "(24, 32), the config expects (16, 32)")


def test_experts_in_transformers_in_memory_layout_load_the_same(tmp_path_factory, tmp_path):
    """The stacked experts under transformers' in-memory names (experts.gate_up_proj, experts.down_proj, router.weight)
    import as the names save_pretrained writes (input_linear, output_linear, router.layer): the same model."""
    from safetensors.torch import load_file, save_file
    import shutil

    folder, prompt, *_ = oracle("granite-moe-k1-tied", tmp_path_factory)
    names = {"block_sparse_moe.input_linear.weight": "block_sparse_moe.experts.gate_up_proj",
             "block_sparse_moe.output_linear.weight": "block_sparse_moe.experts.down_proj",
             "block_sparse_moe.router.layer.weight": "block_sparse_moe.router.weight"}
    tensors = load_file(folder / "model.safetensors")
    renamed = {next((k.replace(a, b) for a, b in names.items() if k.endswith(a)), k): v for k, v in tensors.items()}
    assert sum(k.endswith("experts.gate_up_proj") for k in renamed) == 2
    (tmp_path / "mem").mkdir()
    save_file(renamed, tmp_path / "mem" / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(folder / "config.json", tmp_path / "mem" / "config.json")
    with torch.no_grad():
        assert torch.equal(load_checkpoint(tmp_path / "mem")(prompt[:, :30])[0], load_checkpoint(folder)(prompt[:, :30])[0])


def test_released_config_fields_are_read(tmp_path_factory, tmp_path, refused):
    """Released Granite-4.0-H configs carry ``rope_scaling: null`` (the older RoPE field) and ``normalization_function:
    "rmsnorm"`` (read by no module of transformers' model): the same model; a scaled RoPE is refused by name."""
    folder, prompt, *_ = oracle("granite-moe-k1-tied", tmp_path_factory)
    released = load_checkpoint(edited_copy(folder, tmp_path / "ckpt", rope_scaling=None, normalization_function="rmsnorm"))
    with torch.no_grad():
        assert torch.equal(released(prompt[:, :30])[0], load_checkpoint(folder)(prompt[:, :30])[0])
    refused(edited_copy(folder, tmp_path / "ckpt2", rope_parameters=None, rope_scaling={"rope_type": "yarn", "factor": 4.0}),
            "'rope_parameters'", "'factor'")
