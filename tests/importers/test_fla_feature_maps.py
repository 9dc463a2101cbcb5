"""edgelin's registry maps against fla's own feature-map modules (fla.modules.feature_map, fla's elu_p1),
on the same parameters, in float64 and float32, and the sum-normalisation fla's LinearAttention applies
for norm_q / norm_k."""

from __future__ import annotations

import pytest
import torch

from edgelin.layers.feature_maps import Adjusted, make_feature_map

D = 8


def fla_map(name: str, fla_oracle):
    """fla's module for ``name`` (as LinearAttention builds it) and edgelin's registry name."""
    import fla.modules.feature_map as fm
    from fla.modules.activations import elu_p1

    return {
        "elementwise_product": (fm.HadamardFeatureMap(head_dim=D), "elementwise_product"),
        "hedgehog": (fm.HedgehogFeatureMap(head_dim=D), "hedgehog"),
        "t2r": (fm.T2RFeatureMap(head_dim=D), "t2r"),
        "dpfp": (fm.DPFPFeatureMap(head_dim=D), "dpfp"),
        "elu": (elu_p1, "elu+1"),
        "relu": (torch.nn.ReLU(), "relu"),
        "identity": (torch.nn.Identity(), "identity"),
    }[name]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", ["elementwise_product", "hedgehog", "t2r", "dpfp", "elu", "relu", "identity"])
def test_map_equals_fla(name, dtype, fla_oracle):
    torch.manual_seed(0)
    theirs, ours_name = fla_map(name, fla_oracle)
    ours = make_feature_map(ours_name, D, tie_qk=False)
    if isinstance(theirs, torch.nn.Module) and list(theirs.parameters()):
        with torch.no_grad():
            for p in theirs.parameters():
                p.add_(0.3 * torch.randn(p.shape))
        ours.q.load_state_dict(theirs.state_dict())
        ours.k.load_state_dict({n: t + 1.0 for n, t in theirs.state_dict().items()})  # keys use their own parameters
    x = 3 * torch.randn(2, 5, 3, D, dtype=torch.float64)  # fla's layout [B, T, H, D]: maps act on the last dim
    with torch.no_grad():
        ref = theirs.to(torch.float64)(x) if isinstance(theirs, torch.nn.Module) else theirs(x)
        got = ours(x.to(dtype), is_query=True)
    assert got.shape == ref.shape and got.shape[-1] == ours.out_dim
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
    assert err <= tol, f"relative error {err:.2e}"
    if hasattr(ours, "k"):
        with torch.no_grad():
            assert not torch.allclose(ours(x.to(dtype), is_query=False), got)


def test_adjusted_is_fla_sum_normalisation_then_query_scale():
    inner = make_feature_map("elu+1", D)
    phi = Adjusted(inner, query_scale=0.25, sum_norm_query=True, sum_norm_key=True, sum_eps=1e-4)
    x = torch.randn(2, 3, 4, D, dtype=torch.float64)
    base = inner(x, is_query=True)
    expected = base / (base.sum(-1, keepdim=True) + 1e-4)
    assert torch.allclose(phi(x, is_query=True), 0.25 * expected, rtol=1e-14, atol=0)
    assert torch.allclose(phi(x, is_query=False), expected, rtol=1e-14, atol=0)
    plain = Adjusted(inner, query_scale=0.25)
    assert torch.allclose(plain(x, is_query=False), base, rtol=0, atol=0)
