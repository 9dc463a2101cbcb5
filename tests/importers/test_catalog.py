"""The catalog of families (edgelin.importers.catalog): the one source of what exports, read by the importer
registry, `edgelin models`, `edgelin export --help` and the README; and the refusals of what does not."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from edgelin.cli import main
from edgelin.errors import CheckpointError, UnsupportedCheckpoint
from edgelin.importers import FRAMEWORKS, IMPORTERS, catalog, import_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def test_the_registry_is_the_catalog():
    types = {t for f in catalog.FAMILIES for t in f.model_types}
    assert set(IMPORTERS) == types
    for family in catalog.FAMILIES:
        for model_type, function in zip(family.model_types, family.functions, strict=True):
            assert IMPORTERS[model_type].__name__ == f"{family.module}.{function}"
            assert FRAMEWORKS[model_type] == family.framework
    # a known-but-refused name is never also an exported one of the same framework
    assert not {(f.framework, t) for f in catalog.FAMILIES for t in f.model_types} & set(catalog.KNOWN)


def test_the_readme_table_is_the_catalogs():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start, end = "<!-- models: edgelin models --markdown -->", "<!-- /models -->"
    assert start in text and end in text, "the README's supported-models table is generated: keep its markers"
    table = text[text.index(start) + len(start):text.index(end)].strip()
    assert table == catalog.table_markdown(), "the README's table differs from `edgelin models --markdown`: paste its output"


def test_models_and_export_help_name_every_family():
    runner = CliRunner()
    listing = runner.invoke(main, ["models"])
    helped = runner.invoke(main, ["export", "--help"])
    refused = runner.invoke(main, ["models", "--refused"])
    assert listing.exit_code == helped.exit_code == refused.exit_code == 0
    for family in catalog.FAMILIES:
        for model_type in family.model_types:
            assert re.search(rf"\b{model_type}\b", listing.output) and re.search(rf"\b{model_type}\b", helped.output), model_type
    assert f"{len(catalog.FAMILIES)} families exported" in listing.output
    for (_, model_type), known in catalog.KNOWN.items():
        assert model_type in refused.output and known.why() in refused.output


def _checkpoint(tmp_path: Path, config: dict) -> Path:
    """A folder with this config.json and a weights file that is not safetensors: a refusal by family must come
    before any weight is read."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    (tmp_path / "model.safetensors").write_bytes(b"not read")
    return tmp_path


FLA_FIELDS = {"fuse_norm": True, "fuse_cross_entropy": True, "use_l2warp": False}


@pytest.mark.parametrize("config, fragments", [
    pytest.param({"model_type": "kimi_linear"}, ["transformers' Kimi Linear", "'kimi_linear'", "MLA attention", "nearest family it exports is Qwen3-Next"],
                 id="kimi-linear"),
    pytest.param({"model_type": "minimax"}, ["MiniMax", "lightning attention with mixture-of-experts MLPs"], id="moe"),
    pytest.param({"model_type": "bailing_hybrid"}, ["Ling hybrid", "mixture-of-experts"], id="ling-moe"),
    pytest.param({"model_type": "lfm2_vl", "vision_config": {}}, ["LFM2-VL", "vision-language"], id="vision-language"),
    pytest.param({"model_type": "rwkv6", **FLA_FIELDS}, ["flash-linear-attention's RWKV-6", "token shift", "GLA"], id="fla-rwkv6"),
    pytest.param({"model_type": "hgrn2", **FLA_FIELDS}, ["HGRN2", "state expansion"], id="fla-hgrn2"),
    pytest.param({"model_type": "mamba2", "rmsnorm": True, "D_has_hdim": False, **FLA_FIELDS},
                 ["flash-linear-attention's Mamba2", "transformers' Mamba2Config", "Mamba2ForCausalLM"], id="fla-mamba2"),
    pytest.param({"model_type": "llama"}, ["softmax-attention transformer", "onnxruntime-genai"], id="softmax-only"),
    pytest.param({"model_type": "totally_new"}, ["'totally_new' is not a family edgelin knows", "lfm2", "qwen3_5"], id="unknown"),
])
def test_a_checkpoint_edgelin_cannot_export_is_refused_with_the_blocker_and_the_next_step(tmp_path, config, fragments):
    folder = _checkpoint(tmp_path, config)
    with pytest.raises(UnsupportedCheckpoint) as info:
        import_checkpoint(folder)
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(folder / "config.json"))
    for fragment in fragments + ["edgelin models", "open an issue", "docs/your-model.md"]:
        assert fragment in message, (fragment, message)
    # the command line says the same in one line, exit 2, no traceback
    result = CliRunner().invoke(main, ["export", str(folder), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_transformers_mamba2_still_reaches_its_importer(tmp_path):
    """The same model_type without fla's fields is transformers' and goes to the importer (here: to its field check)."""
    folder = _checkpoint(tmp_path, {"model_type": "mamba2", "some_field_of_the_future": 1})
    with pytest.raises(UnsupportedCheckpoint, match="'some_field_of_the_future' is unknown to edgelin's hf/mamba2 importer"):
        import_checkpoint(folder)


def test_every_unknown_field_is_named_in_one_run(tmp_path):
    folder = _checkpoint(tmp_path, {"model_type": "lfm2", "new_a": 1, "new_b": 2, "new_c": 3})
    with pytest.raises(UnsupportedCheckpoint) as info:
        import_checkpoint(folder)
    assert "config fields 'new_a', 'new_b', 'new_c' are unknown" in str(info.value)


def test_a_family_option_edgelin_lacks_names_the_field_and_the_next_step(tmp_path):
    folder = _checkpoint(tmp_path, {"model_type": "lfm2", "num_experts": 32, "num_experts_per_tok": 4})
    with pytest.raises(UnsupportedCheckpoint) as info:
        import_checkpoint(folder)
    message = str(info.value)
    assert "'num_experts' (mixture-of-experts" in message and "'num_experts_per_tok'" in message
    assert "edgelin models" in message and "\n" not in message


def test_a_malformed_config_is_not_called_unsupported(tmp_path):
    folder = _checkpoint(tmp_path, {"model_type": 7})
    with pytest.raises(CheckpointError) as info:
        import_checkpoint(folder)
    assert not isinstance(info.value, UnsupportedCheckpoint) and "must be a string" in str(info.value)


def test_the_catalog_is_torch_free():
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None; import edgelin.importers.catalog as c; "
            "print(len(c.FAMILIES), c.table_markdown().count('\\n'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert np.array(out.stdout.split(), dtype=int).tolist()[0] == len(catalog.FAMILIES)
