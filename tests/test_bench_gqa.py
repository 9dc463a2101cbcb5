"""The bench's KV-buffer softmax baseline (``edgelin.bench.gqa``) against the softmax twin in PyTorch, and the
position and throughput sections' structure. No timing assertions: speed lives in the bench."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from edgelin import parity
from edgelin.bench import gqa
from edgelin.bench.measure import session_options
from edgelin.config import ModelConfig
from edgelin.runtime.providers import open_session
from edgelin.softmax import SoftmaxLM, rope

LOGITS_BUDGET, STATE_BUDGET = parity.budget("fp32", "logits"), parity.budget("fp32", "state")
TINY = {"vocab_size": 61, "d_model": 32, "n_layers": 2, "n_heads": 2, "head_dim": 16}


def twin(**changes) -> SoftmaxLM:
    torch.manual_seed(3)
    return SoftmaxLM(ModelConfig(**{**TINY, **changes})).float().eval()


def decoder(model: SoftmaxLM, path, *, batch: int, capacity: int, graph_capacity: int = 256) -> gqa.KVBufferDecoder:
    gqa.write_decode_graph(model, path, graph_capacity, 18)
    cfg = model.cfg
    sess = open_session(path, "cpu", options=session_options(1))
    return gqa.KVBufferDecoder(sess, n_layers=cfg.n_layers, n_heads=cfg.n_heads, head_dim=cfg.head_dim, batch=batch, capacity=capacity)


def assert_within(got: np.ndarray, ref: torch.Tensor, budget: dict, where: str) -> None:
    err = parity.errors(got, ref.numpy())
    assert parity.within(err, budget), f"{where}: {err} outside {budget}"


@pytest.mark.parametrize(
    "past, changes",
    [
        pytest.param(0, {}, id="empty-cache"),
        pytest.param(1, {}, id="past-1"),
        pytest.param(15, {}, id="past-15"),
        pytest.param(16, {"tie_embeddings": False}, id="past-16-untied"),
        pytest.param(17, {"head_dim": 32, "n_heads": 1}, id="past-17-one-head-of-32"),
        pytest.param(100, {"n_layers": 1}, id="past-100-one-layer"),
    ],
)
def test_kv_buffer_graph_matches_the_twin_step_by_step(tmp_path, past, changes):
    """Batch 2, several steps after ``past`` cached tokens: logits of every step and the buffers' filled part
    (which holds the new k/v only if the op wrote them in place) against SoftmaxLM's own steps."""
    model = twin(**changes)
    steps = 5
    dec = decoder(model, tmp_path / "g.onnx", batch=2, capacity=past + steps)
    gen = torch.Generator().manual_seed(0)
    cache = None
    with torch.inference_mode():
        if past:
            _, cache = model(torch.randint(0, model.cfg.vocab_size, (2, past), generator=gen))
            dec.load({k: v.numpy() for k, v in cache.items()})
        for step in range(steps):
            tok = torch.randint(0, model.cfg.vocab_size, (2, 1), generator=gen)
            ref, cache = model(tok, cache)
            assert_within(dec.step(tok.numpy()), ref, LOGITS_BUDGET, f"logits at position {past + step}")
            got = dec.cache()
            assert set(got) == set(cache)
            for key, value in cache.items():
                assert got[key].shape == tuple(value.shape)
                assert_within(got[key], value, STATE_BUDGET, f"cache {key} at position {past + step}")
    assert dec.lengths.tolist() == [past + steps] * 2


def test_rows_at_different_positions(tmp_path):
    """One batch, each row at its own position (seqlens_k per row): each row as the twin decodes it alone."""
    model = twin()
    lengths = [0, 7, 33]
    dec = decoder(model, tmp_path / "g.onnx", batch=3, capacity=40)
    gen = torch.Generator().manual_seed(1)
    caches: list = [None] * 3
    full = {k: np.zeros((3, model.cfg.n_heads, max(lengths), model.cfg.head_dim), np.float32) for k in gqa.kv_keys(model.cfg.n_layers)}
    with torch.inference_mode():
        for b, n in enumerate(lengths):
            if n:
                _, caches[b] = model(torch.randint(0, model.cfg.vocab_size, (1, n), generator=gen))
                for k, v in caches[b].items():
                    full[k][b, :, :n] = v[0].numpy()
        dec.load(full, lengths)
        for _ in range(3):
            tok = torch.randint(0, model.cfg.vocab_size, (3, 1), generator=gen)
            got = dec.step(tok.numpy()).copy()
            for b in range(3):
                ref, caches[b] = model(tok[b : b + 1], caches[b])
                assert_within(got[b : b + 1], ref, LOGITS_BUDGET, f"row {b}")
                n = int(dec.lengths[b])
                for k, v in caches[b].items():
                    assert_within(dec.buffers[k][b : b + 1, :, :n], v, STATE_BUDGET, f"row {b} cache {k}")
    assert dec.lengths.tolist() == [n + 3 for n in lengths]
    with pytest.raises(gqa.KVBufferError, match="different lengths"):
        dec.cache()


def test_rope_tables_are_the_twins_rotation():
    """Rotating with the tables (rotate-half) is SoftmaxLM's rope at every position, far out included."""
    D, L = 16, 70000
    cos, sin = gqa.rope_tables(D, L)
    assert cos.shape == sin.shape == (L, D // 2) and cos.dtype == np.float32
    x = torch.randn(1, 2, 3, D)
    for start in (0, 5, L - 3):
        c, s = torch.from_numpy(cos[start : start + 3]), torch.from_numpy(sin[start : start + 3])
        x1, x2 = x[..., : D // 2], x[..., D // 2 :]
        mine = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
        assert torch.equal(mine, rope(x, start)), start


def test_graph_is_fused_and_states_its_capacity(tmp_path):
    import onnx

    model = twin()
    proto = gqa.decode_graph(model, 123, 18)
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count("GroupQueryAttention") == model.cfg.n_layers and "Concat" not in ops
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in next(n for n in proto.graph.node if n.op_type == "GroupQueryAttention").attribute}
    assert attrs["do_rotary"] == 1 and attrs["num_heads"] == attrs["kv_num_heads"] == model.cfg.n_heads
    dec = decoder(model, tmp_path / "g.onnx", batch=1, capacity=123, graph_capacity=123)
    assert gqa.graph_capacity(dec.session) == 123


def test_kv_buffer_errors_are_one_line(tmp_path):
    model = twin()
    path = tmp_path / "g.onnx"
    dec = decoder(model, path, batch=2, capacity=3, graph_capacity=8)
    for _ in range(3):
        dec.step(np.zeros((2, 1), np.int64))
    with pytest.raises(gqa.KVBufferError, match="full"):
        dec.step(np.zeros((2, 1), np.int64))
    with pytest.raises(gqa.KVBufferError, match="does not fit"):
        dec.load({k: np.zeros((2, 2, 4, 16), np.float32) for k in dec.keys})
    with pytest.raises(gqa.KVBufferError, match="longer than the graph's RoPE tables"):
        gqa.KVBufferDecoder(dec.session, n_layers=2, n_heads=2, head_dim=16, batch=1, capacity=9)
    with pytest.raises(gqa.KVBufferError, match="multiple of 16; the model's is 8"):
        gqa.decode_graph(twin(head_dim=8, n_heads=4), 8, 18)


def test_verify_fails_loudly_when_the_kv_buffer_graph_disagrees(tmp_path):
    """The graph of one twin checked against another: BenchError naming the graph; nothing would be timed."""
    from edgelin.bench import baselines
    from edgelin.bench.plan import BenchError, Subject
    from edgelin.model import LinearLM

    cfg = ModelConfig(**TINY)
    subject = Subject(LinearLM(cfg).eval(), "tiny", True, None, 18)
    gqa.write_decode_graph(twin(), tmp_path / "g.onnx", 64, 18)
    torch.manual_seed(4)
    other = SoftmaxLM(cfg).float().eval()
    with pytest.raises(BenchError, match="softmax_gqa logits max abs"):
        baselines.verify({"softmax_gqa": tmp_path / "g.onnx"}, subject, other, 1, lambda _m: None)
    checks = baselines.verify({"softmax_gqa": tmp_path / "g.onnx"}, subject, twin(), 1, lambda _m: None)
    assert parity.within(checks["softmax_gqa"]["logits"], LOGITS_BUDGET)


# ---- the position and throughput sections, without timing ----------------------------------------
def bench_for(tmp_path, memory_cap: int, provider: str = "cpu", **changes):
    from edgelin.bench.plan import QUICK, Subject
    from edgelin.bench.sections import Bench
    from edgelin.model import LinearLM

    subject = Subject(LinearLM(ModelConfig(**{**TINY, **changes})).eval(), "tiny", True, None, 18)
    bench = Bench(subject, "cpu", 1, QUICK, tmp_path, memory_cap, lambda _m: None)
    bench.active_provider = provider
    return bench


def test_position_baselines_are_skipped_by_the_memory_cap_with_why(tmp_path):
    P = 1000
    kv = ModelConfig(**TINY).kv_cache_bytes(P + bench_for(tmp_path, 1).position_steps())
    found = {name: (need, why) for name, need, _, why in bench_for(tmp_path, kv + 1)._position_baselines(P)}
    assert found["softmax_kv"][0] == 2 * kv and "memory cap" in found["softmax_kv"][1]  # past and present alive together
    assert found["softmax_gqa"] == (kv, None)  # one buffer, in place
    found = {name: why for name, _, _, why in bench_for(tmp_path, 1 << 40, provider="cuda")._position_baselines(P)}
    assert found["softmax_kv"] is None and "CPU only" in found["softmax_gqa"]
    found = {name: why for name, _, _, why in bench_for(tmp_path, 1 << 40, head_dim=8)._position_baselines(P)}
    assert found["softmax_kv"] is None and "multiple of 16" in found["softmax_gqa"]


def test_position_table_names_the_strongest_baseline_and_the_skipped():
    from edgelin.bench.report import position_lines

    def ms(m):
        return {"median": m, "p10": m, "p90": m}

    rows = [{"position": 128, "linear_ms": ms(1.0), "linear_state_bytes": 100, "softmax_kv_ms": ms(3.0), "softmax_over_linear": 3.0,
             "softmax_gqa_ms": ms(2.0), "softmax_gqa_over_linear": 2.0, "strongest_baseline": "softmax_gqa", "strongest_over_linear": 2.0,
             "kv_cache_bytes": 1000, "skipped": {}},
            {"position": 65536, "linear_ms": ms(1.0), "linear_state_bytes": 100, "softmax_gqa_ms": ms(9.0), "softmax_gqa_over_linear": 9.0,
             "strongest_baseline": "softmax_gqa", "strongest_over_linear": 9.0, "kv_cache_bytes": 10**9,
             "skipped": {"softmax_kv": "its cache needs ~2 GB > memory cap 1 GB"}}]
    lines = position_lines({"rows": rows, "softmax_baseline": "...", "softmax_gqa_baseline": "..."})
    assert re.search(r"gqa +2\.00x", lines[2]) and "3.00x" in lines[2]  # the strongest named, with its ratio
    assert "skipped" in lines[3] and re.search(r"gqa +9\.00x", lines[3])
    assert any("softmax_kv skipped at P=65,536: its cache needs" in line for line in lines)
