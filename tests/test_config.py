"""ModelConfig: JSON round trip, one typed error per invalid field, derived sizes. Torch-free."""

from __future__ import annotations

import dataclasses
import json

import pytest

from edgelin.config import DECAYS, FEATURE_MAPS, NORMALISATIONS, UPDATES, ModelConfig
from edgelin.errors import ConfigError, EdgelinError

NON_DEFAULT = ModelConfig(
    vocab_size=300, d_model=48, n_layers=3, n_heads=6, head_dim=8, feature_map="performer",
    mlp_ratio=2.5, chunk_size=32, eps=1e-8, normalisation="none", norm_eps=1e-6, tie_embeddings=False,
    feature_seed=-3, n_features=40, cosformer_horizon=1000, conv_size=3, decay="scalar", gate_rank=5,
    update="delta", attn_layers=(0, 2), attn_kv_heads=3, attn_window=64, rope_theta=5e5, max_positions=4096,
)


def test_non_default_example_really_differs_everywhere():
    default = ModelConfig()
    for f in dataclasses.fields(ModelConfig):
        assert getattr(NON_DEFAULT, f.name) != getattr(default, f.name), f.name


@pytest.mark.parametrize("cfg", [ModelConfig(), NON_DEFAULT], ids=["default", "non-default"])
def test_json_round_trip(cfg, tmp_path):
    text = cfg.to_json()
    assert ModelConfig.from_json(text) == cfg
    assert ModelConfig.from_dict(json.loads(text)) == cfg
    assert json.loads(text) == cfg.to_dict()
    path = tmp_path / "config.json"
    path.write_text(text, encoding="utf-8")
    assert ModelConfig.load(path) == cfg
    assert ModelConfig.from_json(ModelConfig.load(path).to_json()).to_json() == text  # stable text


def test_partial_dict_takes_defaults():
    assert ModelConfig.from_dict({"d_model": 64}) == ModelConfig(d_model=64)
    assert ModelConfig.from_dict({}) == ModelConfig()


POSITIVE_INTS = ["vocab_size", "d_model", "n_layers", "n_heads", "head_dim", "chunk_size", "cosformer_horizon", "gate_rank"]
POSITIVE_NUMBERS = ["mlp_ratio", "eps", "norm_eps"]

INVALID = (
    [pytest.param(f, v, id=f"{f}={v!r}") for f in POSITIVE_INTS for v in (0, -1, 2.0, True, "8", None)]
    + [pytest.param("n_features", v, id=f"n_features={v!r}") for v in (-1, 1.5, True, "0")]
    + [pytest.param("conv_size", v, id=f"conv_size={v!r}") for v in (1, -1, 2.0, True, "4", None)]
    + [pytest.param(f, v, id=f"{f}={v!r}") for f in POSITIVE_NUMBERS
       for v in (0, 0.0, -1e-6, float("nan"), float("inf"), True, "1e-6", None)]
    + [pytest.param("tie_embeddings", v, id=f"tie_embeddings={v!r}") for v in (1, 0, "true", None)]
    + [pytest.param("feature_seed", v, id=f"feature_seed={v!r}") for v in (1.0, True, "0", None, 2**64, -(2**63) - 1)]
)


@pytest.mark.parametrize("field, value", INVALID)
def test_invalid_field_is_a_config_error_naming_it(field, value):
    with pytest.raises(ConfigError) as info:
        ModelConfig(**{field: value})
    assert isinstance(info.value, ValueError) and isinstance(info.value, EdgelinError)
    message = str(info.value)
    assert repr(field) in message
    assert "\n" not in message
    # the same through JSON (the path a config.json takes); json cannot carry nan/inf as standard JSON,
    # but Python's json reads NaN/Infinity, so they must be refused there too
    with pytest.raises(ConfigError, match=repr(field)):
        ModelConfig.from_json(json.dumps({field: value}))


@pytest.mark.parametrize("field, allowed, bad", [
    ("feature_map", FEATURE_MAPS, "softmax"),
    ("feature_map", FEATURE_MAPS, "ELU+1"),
    ("normalisation", NORMALISATIONS, "layernorm"),
    ("normalisation", NORMALISATIONS, None),
    ("decay", DECAYS, "retnet"),
    ("decay", DECAYS, "Fixed"),
    ("decay", DECAYS, None),
    ("decay", DECAYS, ["gla"]),
    ("update", UPDATES, "hebbian"),
    ("update", UPDATES, None),
])
def test_enum_field_error_lists_the_allowed_values(field, allowed, bad):
    with pytest.raises(ConfigError) as info:
        ModelConfig(**{field: bad})
    message = str(info.value)
    assert repr(field) in message and repr(bad) in message
    for value in allowed:
        assert value in message


@pytest.mark.parametrize("name", FEATURE_MAPS)
def test_every_feature_map_is_accepted(name):
    assert ModelConfig(feature_map=name).feature_map == name


@pytest.mark.parametrize("name", DECAYS)
def test_every_decay_is_accepted(name):
    assert ModelConfig(decay=name).decay == name


def test_a_config_written_before_the_decay_fields_loads_undecayed():
    data = ModelConfig(d_model=64, conv_size=4).to_dict()
    del data["decay"], data["gate_rank"]
    cfg = ModelConfig.from_dict(data)
    assert cfg.decay == "none" and cfg == ModelConfig(d_model=64, conv_size=4)


def test_edge_values_are_accepted():
    cfg = ModelConfig(vocab_size=1, d_model=1, n_layers=1, n_heads=1, head_dim=1, chunk_size=1,
                      cosformer_horizon=1, n_features=0, mlp_ratio=1, eps=1e-30, feature_seed=-(2**63), gate_rank=1)
    assert cfg.eps == 1e-30
    assert ModelConfig(n_layers=2, feature_seed=2**64 - 2).feature_seed == 2**64 - 2  # last layer seeds 2**64 - 1


@pytest.mark.parametrize("data", [{"d_modle": 64}, {"d_model": 64, "heads": 2, "zzz": 1}])
def test_unknown_fields_are_refused(data):
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict(data)
    message = str(info.value)
    for name in set(data) - {f.name for f in dataclasses.fields(ModelConfig)}:
        assert name in message
    assert "d_model" in message  # the known fields are listed, so a typo is easy to spot


@pytest.mark.parametrize("text", ["[1, 2]", "42", '"elu+1"', "null"])
def test_json_that_is_not_an_object_is_refused(text):
    with pytest.raises(ConfigError, match="JSON object"):
        ModelConfig.from_json(text)


@pytest.mark.parametrize("text", ["", "{", "{'d_model': 64}", '{"d_model": 64,}'])
def test_invalid_json_is_refused(text):
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_json(text)


def test_load_errors_name_the_file(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match="nope.json"):
        ModelConfig.load(missing)
    bad = tmp_path / "bad.json"
    bad.write_text('{"n_heads": 0}', encoding="utf-8")
    with pytest.raises(ConfigError, match=r"bad\.json.*'n_heads'"):
        ModelConfig.load(bad)
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00\x80garbage")
    with pytest.raises(ConfigError, match="binary.json"):
        ModelConfig.load(binary)


def test_frozen_and_replace():
    cfg = ModelConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.d_model = 3  # type: ignore[misc]
    assert cfg.replace(d_model=64).d_model == 64 and cfg.d_model == 256
    with pytest.raises(ConfigError, match="'d_model'"):
        cfg.replace(d_model=0)


@pytest.mark.parametrize("feature_map, head_dim, n_features, expected", [
    ("elu+1", 64, 0, 64),
    ("elu+1", 64, 128, 64),  # n_features only concerns performer
    ("identity", 16, 0, 16),
    ("relu", 16, 0, 16),
    ("softplus", 16, 0, 16),
    ("performer", 64, 0, 64),  # 0 = head_dim
    ("performer", 64, 96, 96),
    ("performer", 16, 7, 7),
    ("cosformer", 64, 0, 128),  # cos and sin halves
    ("cosformer", 16, 99, 32),
])
def test_feature_dim(feature_map, head_dim, n_features, expected):
    assert ModelConfig(feature_map=feature_map, head_dim=head_dim, n_features=n_features).feature_dim == expected


@pytest.mark.parametrize("d_model, mlp_ratio, expected", [
    (256, 4.0, 680),  # 4 * 256 * 2/3 = 682.7; / 8 = 85.3 -> 85 * 8
    (32, 4.0, 88),  # 85.3 / 8 = 10.7 -> 11 * 8
    (48, 2.5, 80),  # 80 exactly
    (60, 4.0, 160),  # 160 exactly
    (1, 1.0, 8),  # floor of 8
    (8, 0.01, 8),
])
def test_mlp_hidden(d_model, mlp_ratio, expected):
    hidden = ModelConfig(d_model=d_model, mlp_ratio=mlp_ratio).mlp_hidden
    assert hidden == expected
    assert hidden % 8 == 0


def test_a_pure_linear_config_writes_no_attention_fields():
    """Configs (and so manifests) of models without attention layers are exactly what they were before hybrids."""
    assert not set(ModelConfig.ATTENTION_FIELDS) & set(ModelConfig().to_dict())
    hybrid = ModelConfig(n_layers=3, attn_layers=[2, 0]).to_dict()
    assert hybrid["attn_layers"] == [0, 2] and set(ModelConfig.ATTENTION_FIELDS) <= set(hybrid)


@pytest.mark.parametrize("changes, field", [
    ({"attn_layers": [4]}, "attn_layers"),
    ({"attn_layers": [1, 1]}, "attn_layers"),
    ({"attn_layers": "1"}, "attn_layers"),
    ({"attn_layers": [True]}, "attn_layers"),
    ({"attn_layers": [1], "attn_kv_heads": 3}, "attn_kv_heads"),  # 3 does not divide n_heads 4
    ({"attn_layers": [1], "attn_window": -1}, "attn_window"),
    ({"attn_layers": [1], "attn_window": 512, "max_positions": 256}, "attn_window"),
    ({"attn_layers": [1], "rope_theta": 0}, "rope_theta"),
    ({"attn_layers": [1], "head_dim": 7}, "head_dim"),
])
def test_bad_attention_fields_name_the_field(changes, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig(**{"n_layers": 4, **changes})
