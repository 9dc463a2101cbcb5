"""SoftmaxLM: the KV cache continues a sequence exactly; its checkpoints never load as a LinearLM."""

import pytest
import torch

from edgelin.checkpoint import load_checkpoint, save_checkpoint
from edgelin.config import ModelConfig
from edgelin.errors import CheckpointError
from edgelin.softmax import SoftmaxLM, load_softmax_checkpoint

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, head_dim=16)


def _model(seed: int = 0) -> SoftmaxLM:
    torch.manual_seed(seed)
    return SoftmaxLM(CFG).double().eval()


@pytest.mark.parametrize(
    "pieces",
    [
        pytest.param((7, 6), id="two-pieces"),
        pytest.param((1, 12), id="one-then-rest"),
        pytest.param((5, 1, 1, 6), id="prefill-then-single-steps"),
    ],
)
def test_cache_continues_the_sequence(pieces):
    model = _model()
    ids = torch.randint(0, CFG.vocab_size, (3, sum(pieces)), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full, full_cache = model(ids)
        outs, cache, start = [], None, 0
        for n in pieces:
            logits, cache = model(ids[:, start : start + n], cache)
            outs.append(logits)
            start += n
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-10, atol=1e-10)
    assert set(cache) == {f"{i}.{n}" for i in range(CFG.n_layers) for n in "kv"}
    for name, t in cache.items():
        assert t.shape == (3, CFG.n_heads, ids.shape[1], CFG.head_dim)
        torch.testing.assert_close(t, full_cache[name], rtol=1e-10, atol=1e-10)


def test_attention_is_causal():
    model = _model()
    ids = torch.randint(0, CFG.vocab_size, (1, 10), generator=torch.Generator().manual_seed(2))
    changed = ids.clone()
    changed[0, 6] = (changed[0, 6] + 1) % CFG.vocab_size
    with torch.no_grad():
        a, b = model(ids)[0], model(changed)[0]
    torch.testing.assert_close(a[:, :6], b[:, :6], rtol=0, atol=0)
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_checkpoint_round_trip_and_never_loads_as_linear(tmp_path):
    torch.manual_seed(0)
    model = SoftmaxLM(CFG)
    save_checkpoint(model, tmp_path)
    loaded = load_softmax_checkpoint(tmp_path)
    ids = torch.randint(0, CFG.vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids)[0], model.eval()(ids)[0])
    with pytest.raises(CheckpointError, match="q_proj"):
        load_checkpoint(tmp_path)
