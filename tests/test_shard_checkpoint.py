"""scripts/shard_checkpoint.py: a random-init checkpoint written shard by shard equals save_pretrained's in keys, shapes
and dtypes, loads in transformers with no missing or unexpected key, has the family's init statistics, and edgelin
imports it."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from edgelin.bench.checkpoints import FAMILIES, VOCAB

spec = importlib.util.spec_from_file_location("shard_checkpoint", Path(__file__).parents[1] / "scripts" / "shard_checkpoint.py")
sc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sc)

_LFM2 = dict(FAMILIES["lfm2"][1], hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
CASES = {
    "qwen3_5_text": dict(FAMILIES["qwen3_5"][1], hidden_size=64, intermediate_size=128, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                         linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=True),
    "lfm2": _LFM2,
    "lfm2_moe": {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
                 "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "num_dense_layers": 1,
                 "num_experts": 4, "num_experts_per_tok": 2, "layer_types": ["conv", "full_attention", "conv"]},
}


def _reference(model_type: str, config: dict, folder: Path):
    """transformers' own model of the config (float32, bfloat16 on save) and its save_pretrained folder."""
    sys.modules.setdefault("fla", None)
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(model_type, **config)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="20KB")
    return model


def _tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_sharded_checkpoint_matches_save_pretrained(model_type, tmp_path):
    import torch
    import transformers

    config = CASES[model_type]
    out = tmp_path / "ckpt"
    got = sc.write_checkpoint(model_type, config, out, "bfloat16", shard_gb=20e-6, seed=1, log=lambda *a, **k: None)
    assert got["shards"] > 2 and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    ref_dir = tmp_path / "ref"
    _reference(model_type, config, ref_dir)
    mine, ref = _tensors(out), _tensors(ref_dir)
    assert sorted(mine) == sorted(ref)
    for name, t in ref.items():
        assert (mine[name].shape, mine[name].dtype) == (t.shape, t.dtype), name
    index = json.loads((out / "model.safetensors.index.json").read_text())
    ref_index = json.loads((ref_dir / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(ref_index["weight_map"])
    assert index["metadata"] == {"total_parameters": ref_index["metadata"]["total_parameters"],
                                 "total_size": ref_index["metadata"]["total_size"]}
    assert set(index["weight_map"].values()) == {p.name for p in out.glob("*.safetensors")}
    others = lambda folder: {p.name for p in folder.iterdir() if not p.name.endswith(".safetensors")}  # noqa: E731
    assert others(out) == others(ref_dir) | {"tokenizer.json", "tokenizer_config.json"}  # a byte-level tokenizer beside it
    assert len(transformers.AutoTokenizer.from_pretrained(out)) == config["vocab_size"]
    # the values: a fresh init of the same kind, tensor by tensor
    for name, t in ref.items():
        a, b = mine[name].float(), t.float()
        if b.numel() < 16 or b.std() == 0:  # norms, biases and other constant inits: the same constants
            if b.std() == 0:
                assert torch.equal(a, b), name
            continue
        assert abs(a.std() / b.std() - 1) < 0.25 and abs(a.mean() - b.mean()) < 0.2 * b.std() + 1e-3, name
        assert not torch.equal(a, b), name
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.dtype == torch.bfloat16  # no forward here: where fla was imported earlier, transformers runs its kernels
    from edgelin.checkpoint import load_checkpoint, open_checkpoint

    opened = open_checkpoint(out)
    assert opened.model_type == model_type and sorted(p.name for p in opened.files) == sorted(set(index["weight_map"].values()))
    lm = load_checkpoint(out)
    assert sum(p.numel() for p in lm.parameters()) > 0
    mode = lambda path: path.stat().st_mode & 0o777  # noqa: E731  # not mkdtemp's private folder
    assert mode(out) == mode(ref_dir) and mode(out / "config.json") == mode(ref_dir / "config.json")
    assert {mode(p) for p in out.glob("*.safetensors")} == {mode(p) for p in ref_dir.glob("*.safetensors")}


def test_refuses_an_existing_folder(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    assert sc.main(["qwen3.5-4b", str(tmp_path / "x")]) == 2
    assert "exists" in capsys.readouterr().err


def test_shard_plan_groups_in_order():
    assert sc.shard_plan([("a", 5), ("b", 5), ("c", 20), ("d", 1)], 10) == [["a", "b"], ["c"], ["d"]]
    assert sc.shard_names(1) == ["model.safetensors"]
    assert sc.shard_names(2) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
