"""Streaming generation: greedy parity with PyTorch, batches, stops, the state after generation, options."""

import numpy as np
import pytest
import torch

from edgelin.config import FEATURE_MAPS
from edgelin.errors import RuntimeInputError
from edgelin.parity import BUDGETS
from edgelin.runtime import Generator, load


PROMPT = "Hello, linear attention!"


def torch_greedy(model, prompt_ids, n):
    """The reference: model.forward on the prompt, then model.step with argmax, n tokens."""
    out = []
    with torch.no_grad():
        logits, state = model(torch.tensor([prompt_ids]))
        for _ in range(n):
            token = logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
            out.append(int(token))
            logits, state = model.step(token, state)
    return out


def streamed_text(session, ids):
    """The text complete after ``ids``, without flushing a trailing partial character."""
    dec = session.tokenizer.decoder()
    return "".join(dec.feed(i) for i in ids)


def greedy(session, prompt, n=24, **kw):
    gen = Generator(session, prompt, max_new_tokens=n, **kw)
    return [t.id for t in gen], gen


@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_greedy_generation_equals_pytorch_token_for_token(exported, feature_map):
    model, export_dir = exported(feature_map)
    session = load(export_dir, provider="cpu")
    prompt_ids = list(PROMPT.encode())
    want = torch_greedy(model, prompt_ids, 64)
    assert len(set(want)) >= 8, f"reference stream too repetitive to compare: {want}"
    got, gen = greedy(session, PROMPT, 64)
    assert got == want
    assert gen.results[0].ids == want and gen.results[0].stop_reason == "length"


def test_streamed_text_is_the_result_text(session):
    gen = Generator(session, PROMPT, max_new_tokens=48, temperature=1.0, seed=3)
    tokens = list(gen)
    assert [t.id for t in tokens] == gen.results[0].ids
    assert "".join(t.text for t in tokens) == gen.text == session.tokenizer.decode(gen.results[0].ids)
    assert gen.stats.new_tokens == 48 and gen.stats.decode_tokens == 47
    assert gen.stats.prompt_tokens == len(PROMPT.encode())


def test_same_seed_same_text_other_seed_other_text(session):
    def sample(seed):
        return greedy(session, PROMPT, 40, temperature=0.9, top_k=40, top_p=0.95, seed=seed)[0]

    assert sample(11) == sample(11)
    assert sample(11) != sample(12)


def test_temperature_zero_is_greedy(session):
    assert greedy(session, PROMPT, temperature=0.0, seed=5)[0] == greedy(session, PROMPT)[0]


def test_chunked_prompt_generates_the_same_tokens(session):
    prompt = "a somewhat longer prompt, " * 12
    assert greedy(session, prompt, prefill_chunk=7)[0] == greedy(session, prompt)[0]


def test_a_batch_of_prompts_of_different_lengths_equals_each_alone(session):
    prompts = ["Hi", "A much longer prompt than the first one", "Mid length"]
    gen = Generator(session, prompts, max_new_tokens=20)
    by_seq = {i: [] for i in range(3)}
    for tok in gen:
        by_seq[tok.seq].append(tok.id)
    for i, p in enumerate(prompts):
        alone = greedy(session, p, 20)[0]
        assert by_seq[i] == alone == gen.results[i].ids


def test_token_id_prompts_work_like_text(session):
    ids = list(PROMPT.encode())
    assert greedy(session, ids)[0] == greedy(session, PROMPT)[0]
    assert greedy(session, [ids, ids[:5]])[1].results[1].ids == greedy(session, ids[:5])[0]


def test_a_stop_sequence_ends_the_text_before_it(session):
    full_ids, ref = greedy(session, PROMPT, 48)
    full = ref.text
    stop = full[20:23]
    assert full.find(stop) == 20  # first occurrence, so the stop is hit exactly there
    gen = Generator(session, PROMPT, max_new_tokens=48, stop=[stop, "never-appears"])
    streamed = "".join(t.text for t in gen)
    assert gen.results[0].stop_reason == "stop"
    assert streamed == gen.text == full[:20]
    # generation went on exactly until the stop sequence was complete
    ids = gen.results[0].ids
    assert ids == full_ids[:len(ids)]
    assert stop in streamed_text(session, ids) and stop not in streamed_text(session, ids[:-1])


def test_eos_ends_a_sequence_and_is_not_yielded(session):
    ids = greedy(session, PROMPT, 30)[0]
    eos = ids[10]
    k = ids.index(eos)
    tokens, gen = greedy(session, PROMPT, 30, eos_id=eos)
    assert tokens == ids[:k]
    assert gen.results[0].stop_reason == "eos"


def test_max_new_tokens_zero_yields_nothing_and_keeps_the_prompt_state(session):
    tokens, gen = greedy(session, PROMPT, 0)
    assert tokens == [] and gen.text == ""
    ref = session.new_state(1)
    session.prefill([list(PROMPT.encode())], ref)
    for (name, a), b in zip(gen.state.numpy().items(), ref.numpy().values()):
        np.testing.assert_array_equal(a, b, err_msg=name)


STATE_REL_L2 = BUDGETS["fp32"]["state"]["rel_l2"]  # the project's fp32 state budget: states are running sums


def assert_state_close(a: np.ndarray, b: np.ndarray, name: str) -> None:
    """int64 states equal; float states within relative L2 of the whole tensor (an element near zero in a
    sum of large terms carries the rounding of the large ones, so elementwise relative checks do not apply)."""
    if a.dtype == np.int64:
        np.testing.assert_array_equal(a, b, err_msg=name)
        return
    rel = np.linalg.norm(a.astype(np.float64) - b) / max(np.linalg.norm(b.astype(np.float64)), 1e-30)
    assert rel <= STATE_REL_L2, f"{name}: relative L2 {rel:.2e} > {STATE_REL_L2}"


def test_state_after_generation_covers_prompt_and_every_generated_token(session):
    tokens, gen = greedy(session, PROMPT, 16)
    ref = session.new_state(1)
    session.prefill([list(PROMPT.encode()) + tokens], ref)  # one prefill over everything
    for (name, a), b in zip(gen.state.numpy().items(), ref.numpy().values()):
        assert_state_close(a, b, name)


def test_batch_state_after_generation_with_early_finishers(session):
    """Sequences leave the batch at different steps; each keeps its own final state, in prompt order."""
    prompts = ["Hi", "A much longer prompt than the first one", "Mid length"]
    first = greedy(session, prompts[0], 30)[1].text
    gen = Generator(session, prompts, max_new_tokens=30, stop=[first[5:7]])  # stops sequence 0 early
    gen.run()
    assert gen.results[0].stop_reason == "stop"
    lengths = [len(r.ids) for r in gen.results]
    assert len(set(lengths)) > 1, lengths
    state = gen.state
    assert state.batch == 3
    for i, (p, r) in enumerate(zip(prompts, gen.results)):
        ref = session.new_state(1)
        session.prefill([list(p.encode()) + r.ids], ref)
        for (name, a), b in zip(state.rows([i]).numpy().items(), ref.numpy().values()):
            assert_state_close(a, b, f"sequence {i} {name}")


def test_continuing_from_a_restored_state_equals_continuing_in_memory(session, tmp_path):
    gen = Generator(session, "Turn one. ", max_new_tokens=12)
    gen.run()
    gen.state.save(tmp_path / "chat.npz")
    in_memory = greedy(session, " Turn two.", 20, state=gen.state.fork())[0]
    restored = greedy(session, " Turn two.", 20, state=session.load_state(tmp_path / "chat.npz", batch=1))[0]
    assert restored == in_memory
    # ... and both equal one uninterrupted run over the whole conversation
    whole = list(b"Turn one. ") + gen.results[0].ids + list(b" Turn two.")
    assert greedy(session, whole, 20)[0] == in_memory


def test_state_is_only_available_after_the_end(session):
    gen = Generator(session, PROMPT, max_new_tokens=5)
    next(gen)
    with pytest.raises(RuntimeInputError, match="has not finished"):
        gen.state


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_new_tokens=-1), "max_new_tokens"), (dict(max_new_tokens=10**9), "max_new_tokens"),
        (dict(max_new_tokens=2.5), "max_new_tokens"), (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"), (dict(top_p=1.01), "top_p"), (dict(top_k=-3), "top_k"),
        (dict(prefill_chunk=0), "prefill_chunk"), (dict(stop=[""]), "stop sequences"),
    ],
    ids=["max-neg", "max-huge", "max-float", "temp-neg", "top_p-0", "top_p-big", "top_k-neg", "chunk-0", "stop-empty"],
)
def test_bad_options_are_refused(session, kwargs, match):
    with pytest.raises(RuntimeInputError, match=match):
        Generator(session, PROMPT, **kwargs)


@pytest.mark.parametrize(
    "prompt, match",
    [("", "prompt 0 is empty"), ([], "no prompt"), (["ok", ""], "prompt 1 is empty"), (["ok", [1, 2]], "mix of text"),
     ([1, 300], "token id 300"), ([[1, 2], [-5]], "token id -5")],
    ids=["empty-text", "empty-list", "empty-in-batch", "mixed", "id-too-large", "id-negative"],
)
def test_bad_prompts_are_refused_before_anything_runs(session, prompt, match):
    with pytest.raises(RuntimeInputError, match=match):
        Generator(session, prompt, max_new_tokens=3)


def test_a_state_for_another_batch_size_is_refused(session):
    with pytest.raises(RuntimeInputError, match="holds 2 sequence\\(s\\) but there are 1 prompt"):
        Generator(session, PROMPT, state=session.new_state(2))


def test_generate_text_streams_and_reports_timings(tiny, tmp_path):
    from edgelin.runtime import generate_text

    pieces = []
    out = generate_text(tiny[1], PROMPT, max_new_tokens=20, provider="cpu", on_text=pieces.append, state_out=tmp_path / "s.npz")
    assert "".join(pieces) == out["text"] and all(pieces)
    assert out["provider"] == "cpu" and out["new_tokens"] == 20 and out["decode_tokens"] == 19
    assert out["prompt_tokens"] == len(PROMPT.encode())
    for key in ("time_to_first_token_s", "prefill_tokens_per_s", "decode_tokens_per_s", "load_s"):
        assert out[key] > 0
    assert (tmp_path / "s.npz").is_file() and out["state_out"] == str(tmp_path / "s.npz")


def test_a_model_without_a_text_tokenizer_takes_ids(exported):
    from edgelin.errors import ManifestError

    # a model of 1,024 ids has no text tokenizer (kind 'ids'): the export test_node and test_site read too
    _, ids_only = exported("elu+1", options={"precision": "fp32"}, vocab_size=1024)
    session = load(ids_only, provider="cpu")
    assert session.manifest.tokenizer["kind"] == "ids"
    with pytest.raises(ManifestError, match="tokenizer kind 'ids'.*pass token ids"):
        Generator(session, "text", max_new_tokens=3)
    with pytest.raises(ManifestError, match="tokenizer kind 'ids'"):
        Generator(session, [1, 2, 3], max_new_tokens=3, stop=["x"])
    tokens = list(Generator(session, [1, 2, 3], max_new_tokens=3))
    assert len(tokens) == 3 and all(t.text == "" for t in tokens)
