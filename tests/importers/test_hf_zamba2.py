"""edgelin's import of Hugging Face transformers Zamba2 checkpoints against transformers' own model.

Same oracle as test_hf_mamba2.py (testkit/hf_oracle.py, with testkit/oracles/zamba2.py for Zamba2's hybrid cache): a
tiny random Zamba2ForCausalLM, a 150-token prefill then 20 cached decode steps, batch 2. Budget, fp32: max abs logits
<= 1e-4; the cache (Mamba2's states and conv windows, the hybrid layers' keys and values) is compared too. Mamba2
layers are edgelin.layers.mamba2's; hybrid layers are edgelin.layers.shared_block's (kind "zamba2/hybrid"): a shared
attention + MLP block fed [hidden, input embeddings], stored once however many layers use it, per-use adapters, a
linear and a Mamba2 layer.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from edgelin.checkpoint import load_checkpoint
from edgelin.importers import IMPORTERS
from testkit import hf_oracle, max_abs
from testkit import rel_l2 as rel  # |got - ref|_2 / |ref|_2
from testkit.stateful import (edited_copy, export_vs_reference, import_vs_reference,
                              pieces_and_steps_agree, protocol_and_naive_agree)

pytest.importorskip("transformers", reason="transformers is not installed; pip install -e '.[test]'")

MAX_ABS = 1e-4
STATE_REL = 1e-5
BATCH, PROMPT, STEPS = 2, 150, 20
VOCAB = 97
TINY = {"vocab_size": VOCAB, "hidden_size": 32, "num_attention_heads": 4, "mamba_d_state": 8, "intermediate_size": 40}
CASES = {  # id -> (config, hybrid layer -> the first hybrid layer using its shared block)
    # two shared blocks used in turn by hybrid layers 1, 2, 3 (3 reuses 1's); adapters on q, k, v and the MLP; RoPE;
    # 8 Mamba heads in 2 groups; exact GELU; tied embeddings. time_step_min (dt's lower clamp, and the low end of dt's
    # init) below every dt: transformers clamps in its prefill only (the clamp: test_dt_is_clamped_below_...)
    "blocks2-adapters-rope": ({
        **TINY, "num_hidden_layers": 4, "layers_block_type": ["mamba", "hybrid", "hybrid", "hybrid"],
        "num_mem_blocks": 2, "use_shared_attention_adapter": True, "adapter_rank": 4, "use_mem_rope": True,
        "n_mamba_heads": 8, "mamba_ngroups": 2, "time_step_min": 1e-5,
    }, {1: 1, 2: 2, 3: 1}),
    # the first and last layers hybrid, one num_mem_blocks, but untied embeddings: transformers then ties nothing, so
    # each hybrid layer has a block of its own; grouped heads (4 / 2 KV), no RoPE, no attention adapters (the MLP's
    # only); biases (add_bias_linear); SiLU; 4 Mamba heads of 16, one group, a conv of 3; long context
    "untied-gqa-bias-silu": ({
        **TINY, "num_hidden_layers": 3, "layers_block_type": ["hybrid", "linear_attention", "hybrid"], "num_key_value_heads": 2,
        "add_bias_linear": True, "hidden_act": "silu", "adapter_rank": 8, "n_mamba_heads": 4, "mamba_ngroups": 1,
        "mamba_d_conv": 3,
        "tie_word_embeddings": False, "use_long_context": True, "rms_norm_eps": 1e-6, "time_step_min": 1e-5,
    }, {0: 0, 2: 2}),
}
# the clamp at work: dt drawn in [0.05, 0.06] and perturbed (about half below 0.05), clamped below at 0.05
DT_FLOOR = {**TINY, "num_hidden_layers": 2, "layers_block_type": ["mamba", "hybrid"], "time_step_min": 0.05,
            "time_step_max": 0.06}
_RESULTS: dict[str, tuple] = {}


def oracle(case_id: str, tmp_path_factory):
    return hf_oracle.cached(_RESULTS, case_id, "zamba2", CASES[case_id][0], tmp_path_factory, batch=BATCH, prompt=PROMPT,
                            steps=STEPS, vocab=VOCAB)


def test_registry_lists_zamba2():
    assert "zamba2" in IMPORTERS


@pytest.mark.parametrize("case_id", list(CASES))
def test_import_matches_transformers(case_id, tmp_path_factory):
    folder, prompt, steps, ref = oracle(case_id, tmp_path_factory)
    model, state = import_vs_reference(folder, prompt, steps, ref["prefill"], ref["decode"], MAX_ABS, against="transformers")
    config, owners = CASES[case_id]
    for i, block in enumerate(model.blocks):
        mamba = block.attn if i not in owners else block.attn.mamba
        assert mamba.kind == "mamba2" and block.attn.kind == ("zamba2/hybrid" if i in owners else "mamba2") and block.mlp is None
        S = ref[f"{i}.recurrent"].transpose(-1, -2)  # transformers: [B, H, P, N]; edgelin: [B, H, N, P]
        assert state[f"{i}.S"].shape == S.shape and rel(state[f"{i}.S"], S) <= STATE_REL
        assert state[f"{i}.conv"].shape == ref[f"{i}.conv"].shape and rel(state[f"{i}.conv"], ref[f"{i}.conv"]) <= STATE_REL
        if i in owners:  # each use keeps its own KV cache
            for name in ("key", "value"):
                mine, theirs = state[f"{i}.{name}"], ref[f"{i}.{name}"]
                assert mine.shape == theirs.shape and rel(mine, theirs) <= STATE_REL
            assert block.attn.block is model.blocks[owners[i]].attn.block  # the same module, registered in its first use only
            assert ("shared" in block.attn._modules) is (owners[i] == i)
        else:
            assert f"{i}.key" not in state and f"{i}.key" not in ref
    assert model.max_positions == (16384 if config.get("use_long_context") else 4096) and model.state_decays


def test_dt_is_clamped_below_at_time_step_min(tmp_path_factory, tmp_path):
    """Zamba2's mixers clamp dt below at ``time_step_min``: with the clamp at work the prefill matches transformers',
    and the same weights without the clamp (time_step_min 0) do not. (transformers' one-token step does not clamp,
    edgelin's does: the decode is not compared here.)"""
    folder, prompt, _, ref = hf_oracle.cached(_RESULTS, "dt-floor", "zamba2", DT_FLOOR, tmp_path_factory, batch=BATCH,
                                              prompt=PROMPT, steps=1, vocab=VOCAB)
    with torch.no_grad():
        clamped = max_abs(load_checkpoint(folder)(prompt)[0], ref["prefill"])
        unclamped = max_abs(load_checkpoint(edited_copy(folder, tmp_path / "ckpt", time_step_min=0.0))(prompt)[0], ref["prefill"])
    assert clamped <= MAX_ABS and unclamped > max(MAX_ABS, 10 * clamped), (clamped, unclamped)


def test_shared_weights_are_held_once(tmp_path_factory, tmp_path, refused):
    """The model's state dict and parameters hold each shared block once; a checkpoint that also stores the tied
    copies (every hybrid layer's shared_transformer) loads the same model, and one whose copies differ is refused."""
    folder, prompt, *_ = oracle("blocks2-adapters-rope", tmp_path_factory)
    model = load_checkpoint(folder)
    names = list(model.state_dict())
    assert sum(".shared.self_attn.q_proj." in n for n in names) == 2  # two blocks, three uses
    assert len(names) == len({id(t) for t in model.state_dict().values()})
    twin = copy.deepcopy(model)  # a deep copy (the quantised reference is built from one): its uses share its own block
    assert twin.blocks[3].attn.block is twin.blocks[1].attn.shared is not model.blocks[1].attn.shared
    other = model.with_chunk_size(8)  # another chunk length: the same layers and weights, no copy
    assert other.blocks[3].attn.block is other.blocks[1].attn.shared is model.blocks[1].attn.shared
    assert other.chunk_size == 8 != model.chunk_size
    tensors = load_file(folder / "model.safetensors")
    copies = {k.replace("model.layers.1.", "model.layers.3.", 1): v.clone() for k, v in tensors.items()
              if k.startswith("model.layers.1.shared_transformer.")}
    assert copies and not set(copies) & set(tensors)
    full = edited_copy(folder, tmp_path / "full")
    save_file({**tensors, **copies}, full / "model.safetensors")
    with torch.no_grad():
        assert torch.equal(load_checkpoint(full)(prompt[:, :30])[0], model(prompt[:, :30])[0])
    name = "model.layers.3.shared_transformer.self_attn.q_proj.weight"
    save_file({**tensors, **copies, name: copies[name] + 1.0}, full / "model.safetensors")
    refused(full, "model.layers.1.shared_transformer.self_attn.q_proj.weight", name, "differ")


def test_protocol_forms_and_pieces(tmp_path_factory):
    """The protocol; every form's naive reference (attention's and Mamba2's) against the chunk form in float64;
    prefill in pieces (1 token: shorter than the conv window; C - 1; C + 1, with a chunk C of 8) and token by token
    against one prefill."""
    folder, *_ = oracle("blocks2-adapters-rope", tmp_path_factory)
    model = load_checkpoint(folder).with_chunk_size(8)
    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))
    protocol_and_naive_agree(model, "hf/zamba2", ids)
    pieces_and_steps_agree(model, ids, (1, 7, 9))


@pytest.mark.slow  # one export of a 4-layer model and validate's transformers run
def test_export_matches_transformers(tmp_path_factory, tmp_path):
    """Both ONNX graphs against transformers, validate against transformers itself (greedy ids included), the
    JavaScript runtime on the export, and the shared blocks' weights stored once in weights.data though both of block
    0's uses read them."""
    import onnx
    from testkit.node import javascript_check

    from edgelin.exporters import export
    from edgelin.validate import validate

    folder, prompt, steps, ref = oracle("blocks2-adapters-rope", tmp_path_factory)
    out = tmp_path_factory.mktemp("zamba2-export") / "export"
    summary = export(folder, out, check=False).summary()
    assert "per position of context" in summary, summary
    export_vs_reference(out, prompt, steps, ref["prefill"], ref["decode"], MAX_ABS, against="transformers")
    report = validate(out, folder, steps=16, long=300, upstream="required")  # and vs transformers itself
    assert report.passed, report.table()
    report = javascript_check(out, tmp_path)  # runtime/web/edgelin.mjs in node (onnxruntime-node): both graphs vs golden
    assert report["passed"] and len(report["results"]) == 2, report
    data = (out / "weights.data").read_bytes()
    model = load_checkpoint(folder)
    for shared in (model.blocks[1].attn.shared, model.blocks[2].attn.shared):
        for w in (shared.self_attn.q_proj.weight, shared.feed_forward.gate_up_proj.weight):
            w = w.detach().numpy()
            assert data.count(w.tobytes()) + data.count(np.ascontiguousarray(w.T).tobytes()) == 1
    proto = onnx.load(str(out / "prefill.onnx"), load_external_data=False)
    assert not {node.op_type for node in proto.graph.node} & {"Loop", "Scan"}
    spots = [tuple(e.value for e in t.external_data if e.key in ("offset", "length"))
             for t in proto.graph.initializer if t.external_data]
    assert len(spots) > len(set(spots))  # initializers of several uses pointing at the same bytes


def test_a_misread_field_departs_at_the_first_hybrid_layer(tmp_path_factory, tmp_path):
    """transformers' run of the checkpoint (per-layer outputs, as validate's upstream check takes them) against the
    import of the same weights with use_mem_rope read the other way: it departs at layer 1, the first hybrid layer
    (layer 0, a Mamba2 layer, agrees); the import of the checkpoint itself agrees at every layer."""
    from edgelin import parity, upstream

    folder, prompt, steps, _ = oracle("blocks2-adapters-rope", tmp_path_factory)
    prompt, steps = prompt[:, :40].numpy(), steps[:, :2].numpy()
    ref = upstream.run(folder, "transformers", prompt, steps, greedy=1)
    bound = parity.BUDGETS["fp32"]["upstream"]["rel_l2"]
    for checkpoint, said in ((folder, "every layer's output agrees"),
                             (edited_copy(folder, tmp_path / "ckpt", use_mem_rope=False),
                              "first departs at layer 1 (zamba2/hybrid)")):
        model = load_checkpoint(checkpoint)
        prefill, *_, hidden = upstream.import_outputs(model, prompt, steps, 1)
        assert upstream.first_departure(model, hidden, ref.hidden, bound).startswith(said)


@pytest.mark.parametrize("changes, field, fragment", [
    ({"hidden_act": "relu"}, "hidden_act", "'gelu', 'silu'"),
    ({"layers_block_type": ["mamba", "attention", "hybrid", "hybrid"]}, "layers_block_type", "'hybrid' layers"),
    ({"num_hidden_layers": 5}, "num_hidden_layers", "lists 4 layers"),
    ({"layers_block_type": None}, "num_hidden_layers", "lists 54 layers"),  # Zamba2Config's default pattern: 54 layers
    ({"n_mamba_heads": 6}, "n_mamba_heads", "must divide mamba_expand x hidden_size"),
    ({"mamba_ngroups": 3}, "mamba_ngroups", "must divide n_mamba_heads (8)"),
    ({"num_attention_heads": 5}, "num_attention_heads", "must divide 2 x hidden_size (64)"),
    ({"num_key_value_heads": 2}, "use_shared_attention_adapter", "without grouped heads"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0}}, "rope_parameters", "unknown"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0}}, "rope_parameters", "rope_type 'linear'"),
    ({"time_step_min": -1}, "time_step_min", ">= 0"),
    ({"use_shared_mlp_adapter": False}, "use_shared_mlp_adapter", "unknown"),
])
def test_unsupported_options_are_refused_by_name(changes, field, fragment, tmp_path_factory, tmp_path, refused):
    folder, *_ = oracle("blocks2-adapters-rope", tmp_path_factory)
    refused(edited_copy(folder, tmp_path / "ckpt", **changes), repr(field), fragment)


def test_weights_that_disagree_with_the_config_name_the_tensor(tmp_path_factory, tmp_path, refused):
    folder, *_ = oracle("blocks2-adapters-rope", tmp_path_factory)
    refused(edited_copy(folder, tmp_path / "ckpt", adapter_rank=5), "feed_forward.gate_up_proj_adapter_list.0.0.weight",
            "(4, 32)")

