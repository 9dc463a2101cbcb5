"""Reading fla checkpoints: the model_type dispatch, refused options and fields, missing / extra / misshaped /
disagreeing tensors, tied weights saved under either name, and the CLI's exit status. Every refusal names
what is wrong. These tests build checkpoints with fla but do not run its kernels."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from edgelin.checkpoint import load_checkpoint
from edgelin.cli import main
from edgelin.importers import IMPORTERS, supported
from edgelin.protocol import ExportableModel, check_model


@pytest.fixture(scope="module")
def base(fla_oracle, tmp_path_factory):
    """A valid checkpoint with learned untied maps, grouped heads and the denominator (built once)."""
    return fla_oracle.build(tmp_path_factory.mktemp("base"), num_kv_heads=2, norm_feature_map=True)


@pytest.fixture
def ckpt(base, tmp_path):
    """A private copy of ``base`` that a test may break."""
    return shutil.copytree(base, tmp_path / "ckpt")


def edit_config(folder, **changes):
    path = folder / "config.json"
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is ...:
            data.pop(key)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def edit_weights(folder, fn):
    tensors = load_file(folder / "model.safetensors")
    fn(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_loads_as_a_protocol_model(base):
    model = load_checkpoint(base)
    assert isinstance(model, ExportableModel)
    check_model(model)
    assert model.vocab_size == 97 and not model.training
    specs = {s.key: s.shape for s in model.state_specs()}
    assert specs == {f"{i}.{n}": ("batch", 2, 16, 16)[: 4 if n == "S" else 3] for i in (0, 1) for n in ("S", "z")}
    assert model.model_config()["family"] == "fla/linear_attn"
    json.dumps(model.model_config())


def test_state_is_carried_per_key_value_head_and_chunk_changes_nothing(base):
    model = load_checkpoint(base)
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, ref_state = model(ids)
        other = model.with_chunk_size(7)
        logits, state = other(ids)
        assert other.chunk_size == 7 and model.chunk_size == 64
        assert (logits - ref).abs().max() <= 1e-5
        for key in ref_state:
            assert state[key].shape[1] == 2  # num_kv_heads, not num_heads (4)
            assert torch.allclose(state[key], ref_state[key], rtol=1e-5, atol=1e-6)


def test_registry_lists_linear_attn():
    assert "linear_attn" in IMPORTERS and supported() == tuple(sorted(IMPORTERS))


def test_unknown_model_type_lists_the_supported_ones(ckpt, refused):
    edit_config(ckpt, model_type="not_a_family")
    refused(ckpt, "'not_a_family'", "linear_attn", "edgelin models")


def test_a_known_family_not_exported_names_its_blocker(ckpt, refused):
    edit_config(ckpt, model_type="mamba")  # fla's Mamba: its config still carries fla's own fields
    refused(ckpt, "flash-linear-attention's Mamba", "'mamba'", "selective scan", "edgelin models", "docs/your-model.md")


@pytest.mark.parametrize("field, value, fragment", [
    pytest.param("attnres_block_size", 2, "attention residuals", id="attnres_block_size"),
    pytest.param("hidden_act", "powlu", "'swish'", id="hidden_act"),
    pytest.param("feature_map", "taylor", "'elementwise_product'", id="feature_map"),
    pytest.param("num_kv_heads", 3, "divide", id="num_kv_heads"),
    pytest.param("expand_k", 0.3, "integer", id="expand_k"),
    pytest.param("norm_q", "yes", "true or false", id="norm_q-type"),
    pytest.param("norm_eps", 0, "positive", id="norm_eps"),
    pytest.param("some_new_option", 1, "unknown to edgelin's fla/linear_attn importer; it may change the model, so the checkpoint is refused (docs/importers.md lists", id="unknown-field"),
])
def test_unsupported_option_is_refused_by_name(ckpt, field, value, fragment, refused):
    edit_config(ckpt, **{field: value})
    refused(ckpt, repr(field), fragment)


def test_missing_tensor_is_named(ckpt, refused):
    edit_weights(ckpt, lambda t: t.pop("model.layers.1.attn.feature_map_k.layer2.bias"))
    refused(ckpt, "missing", "model.layers.1.attn.feature_map_k.layer2.bias")


def test_extra_tensor_is_named(ckpt, refused):
    edit_weights(ckpt, lambda t: t.update({"model.layers.0.attn.g_proj.weight": torch.zeros(4, 4)}))
    refused(ckpt, "unexpected", "model.layers.0.attn.g_proj.weight")


def test_misshaped_tensor_is_named(ckpt, refused):
    edit_weights(ckpt, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(95, 64)}))
    refused(ckpt, "model.layers.0.mlp.up_proj.weight", "(95, 64)", "(96, 64)")


def test_config_that_disagrees_with_weights_names_the_tensor(ckpt, refused):
    edit_config(ckpt, num_kv_heads=4)  # k_proj and v_proj are saved for 2 key/value heads
    refused(ckpt, "model.layers.0.attn.k_proj.weight", "(32, 64)", "(64, 64)")


def test_untied_checkpoint_without_lm_head_is_refused(ckpt, refused):
    edit_weights(ckpt, lambda t: t.pop("lm_head.weight"))
    refused(ckpt, "missing", "lm_head.weight")


def test_tied_embeddings_saved_under_either_name_or_both(fla_oracle, tmp_path, refused):
    folder = fla_oracle.build(tmp_path / "tied", tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(folder / "model.safetensors")  # what save_pretrained writes
    ref = load_checkpoint(folder)
    ids = torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        expected = ref(ids)[0]
    both = shutil.copytree(folder, tmp_path / "both")
    edit_weights(both, lambda t: t.update({"lm_head.weight": t["model.embeddings.weight"].clone()}))
    only_head = shutil.copytree(folder, tmp_path / "head")
    edit_weights(only_head, lambda t: t.update({"lm_head.weight": t.pop("model.embeddings.weight")}))
    for variant in (both, only_head):
        with torch.no_grad():
            assert torch.equal(load_checkpoint(variant)(ids)[0], expected)
    edit_weights(both, lambda t: t["lm_head.weight"].add_(1e-3))
    refused(both, "tied", "lm_head.weight", "model.embeddings.weight")


def test_tied_feature_maps_saved_under_either_name(fla_oracle, tmp_path):
    folder = fla_oracle.build(tmp_path / "tied", feature_map="hedgehog", tie_feature_map_qk=True, tied_save=True)
    names = load_file(folder / "model.safetensors")
    kept = [n for n in names if ".feature_map_" in n]
    assert kept and all(".feature_map_k." in n for n in kept)  # one copy, under the key map's name
    ids = torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        expected = load_checkpoint(folder)(ids)[0]
    renamed = shutil.copytree(folder, tmp_path / "q")
    edit_weights(renamed, lambda t: t.update({n.replace("feature_map_k", "feature_map_q"): t.pop(n) for n in kept}))
    with torch.no_grad():
        assert torch.equal(load_checkpoint(renamed)(ids)[0], expected)


def test_pickle_only_folder_is_refused(ckpt, refused):
    (ckpt / "model.safetensors").rename(ckpt / "pytorch_model.bin")
    refused(ckpt, "pytorch_model.bin", "refused")


@pytest.mark.parametrize("change, fragment", [
    pytest.param({"model_type": "gla2"}, "'gla2'", id="model_type"),
    pytest.param({"attnres_block_size": 4}, "'attnres_block_size'", id="option"),
])
def test_cli_export_exits_2_with_one_line(ckpt, tmp_path, change, fragment):
    edit_config(ckpt, **change)
    result = CliRunner().invoke(main, ["export", str(ckpt), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert "edgelin: error:" in result.output and fragment in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_half_precision_weights_load_as_float32(ckpt):
    edit_weights(ckpt, lambda t: t.update({n: v.to(torch.bfloat16) for n, v in t.items()}))
    model = load_checkpoint(ckpt)
    weight = model.blocks[0].attn.q_proj.weight
    saved = load_file(ckpt / "model.safetensors")["model.layers.0.attn.q_proj.weight"]
    assert weight.dtype == torch.float32 and torch.equal(weight, saved.to(torch.float32))


def test_an_import_without_lengths_exports_plain_and_prefills_a_batch_one_by_one(base, tmp_path):
    """fla imports do not declare accepts_lengths: `export --ragged` refuses them by name, the plain export
    runs a batch of prompts of different lengths one by one, each as it runs alone."""
    import numpy as np

    from edgelin.errors import ExportError
    from edgelin.exporters import export
    from edgelin.protocol import accepts_lengths
    from edgelin.runtime import load

    model = load_checkpoint(base)
    assert not accepts_lengths(model)
    with pytest.raises(ExportError, match="accepts_lengths"):
        export(model, tmp_path / "ragged", ragged=True)
    export(model, tmp_path / "plain", check=False)
    session = load(tmp_path / "plain", provider="cpu", threads=1)
    assert "one by one" in session.ragged_fallback
    prompts = [np.arange(n) % 97 for n in (3, 17, 1)]
    last, state = session.prefill_batch(prompts)
    for b, ids in enumerate(prompts):
        alone = session.new_state(1)
        np.testing.assert_array_equal(last[b], session.prefill(ids[None], alone, last_only=True)[0])
        for name, a in alone.numpy().items():
            np.testing.assert_array_equal(state.numpy()[name][b], a[0], err_msg=name)
