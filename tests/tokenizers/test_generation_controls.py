"""The generation controls hold Hugging Face ``generate``'s semantics: the repetition penalty's and the n-gram ban's
processed logits equal transformers' ``RepetitionPenaltyLogitsProcessor`` and ``NoRepeatNGramLogitsProcessor`` bit for
bit, and greedy ids with a penalty, no_repeat_ngram_size, min_new_tokens and a list of eos ids equal ``model.generate`` on a tiny transformers model (driven through edgelin's Generator
by a session that runs that same model). transformers runs in a child process with triton hidden (with triton
installed it picks GPU kernels and fails on a CPU-only machine), so nothing leaks into the test process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from edgelin.errors import RuntimeInputError
from edgelin.runtime import Generator
from edgelin.runtime.controls import NGrams, process_logits

CHILD = textwrap.dedent(r'''
    import json, sys
    sys.modules["triton"] = None
    sys.modules["fla"] = None
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor
    from edgelin.runtime.controls import NGrams, process_logits
    from edgelin.runtime.generate import Generator

    torch.manual_seed(0)
    out = {"processor": []}
    rng = np.random.default_rng(0)
    for penalty in (1.3, 0.7, 2.0):
        logits = rng.standard_normal((3, 50)).astype(np.float32) * 4
        logits[0, :5] = 0.0  # zeros: divided (HF's "score < 0" is false)
        ids = rng.integers(0, 50, (3, 12))
        want = RepetitionPenaltyLogitsProcessor(penalty)(torch.from_numpy(ids), torch.from_numpy(logits.copy())).numpy()
        got = process_logits(logits, [np.unique(r) for r in ids], [0, 0, 0], repetition_penalty=penalty)
        out["processor"].append({"equal": bool(np.array_equal(got, want)), "changed": int((got != logits).sum())})
    out["ngram"] = []
    for n in (1, 2, 3, 5):
        for length in (n - 2, n - 1, n, 40):  # no n-gram yet / the first one possible / long sequences with repeats
            if length < 0:
                continue
            logits = rng.standard_normal((3, 6)).astype(np.float32)
            ids = rng.integers(0, 6, (3, length))
            if length == 40:  # a sequence twice over: its last (n-1)-gram ended the first copy, so an id is banned
                ids[:, 20:] = ids[:, :20]
            want = NoRepeatNGramLogitsProcessor(n)(torch.from_numpy(ids), torch.from_numpy(logits.copy())).numpy()
            got = process_logits(logits, [], [0, 0, 0], banned=[NGrams(n, r.tolist()).banned() for r in ids])
            out["ngram"].append({"equal": bool(np.array_equal(got, want)), "changed": int((got != logits).sum()), "n": n, "length": length})

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0)  # sharper logits: greedy runs that loop without a penalty

    class State:
        def __init__(self):
            self.ids = []

    class TorchSession:
        """The Session surface Generator uses (batch 1), running the transformers model on the whole sequence."""
        vocab_size = cfg.vocab_size
        tokenizer = None

        def new_state(self, batch=1):
            return State()

        def _logits(self, state, ids):
            state.ids += ids
            with torch.no_grad():
                return model(torch.tensor([state.ids])).logits[:, -1].float().numpy()

        def prefill(self, ids, state, chunk=None, last_only=True):
            return self._logits(state, ids[0].tolist())

        def decode(self, ids, state):
            return self._logits(state, ids[0].tolist())[:, None]

    out["generate"] = []
    for prompt, kw in (([5, 9, 9, 3], dict(repetition_penalty=1.5, max_new_tokens=40)),
                       ([7, 11], dict(repetition_penalty=1.2, max_new_tokens=30, min_new_tokens=12)),
                       ([4, 4, 4, 4, 8], dict(repetition_penalty=1.0, max_new_tokens=30)),
                       ([3, 1, 4, 1, 5], dict(repetition_penalty=0.8, max_new_tokens=25)),
                       ([4, 4, 4, 4, 8], dict(repetition_penalty=1.0, no_repeat_ngram_size=2, max_new_tokens=30)),
                       ([5, 9, 9, 3], dict(repetition_penalty=1.1, no_repeat_ngram_size=3, max_new_tokens=40, min_new_tokens=10))):
        for eos in ([2], [2, 13, 17, 21, 25]):
            with torch.no_grad():
                ref = model.generate(torch.tensor([prompt]), do_sample=False, eos_token_id=eos, pad_token_id=0, **kw)[0, len(prompt):].tolist()
            gen = Generator(TorchSession(), prompt, eos_id=eos, **kw).run()
            ours = gen.results[0].ids + ([ref[len(gen.results[0].ids)]] if gen.results[0].stop_reason == "eos" else [])
            out["generate"].append({"ref": ref, "ours": ours, "stop": gen.results[0].stop_reason, "kw": kw, "eos": eos})
    print(json.dumps(out))
''')


@pytest.fixture(scope="module")
def transformers_run():
    pytest.importorskip("transformers")
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_processed_logits_equal_transformers_repetition_penalty(transformers_run):
    for case in transformers_run["processor"]:
        assert case["equal"] and case["changed"] > 0


def test_processed_logits_equal_transformers_no_repeat_ngram(transformers_run):
    cases = transformers_run["ngram"]
    assert all(case["equal"] for case in cases), [c for c in cases if not c["equal"]]
    # not vacuous: every n bans something on the long rows; nothing is banned before a first n-gram can repeat
    assert all(c["changed"] > 0 for c in cases if c["length"] == 40)
    assert all(c["changed"] == 0 for c in cases if c["length"] < c["n"] and c["n"] > 1)


def test_ngrams_equal_a_scan_of_the_sequence():
    rng = np.random.default_rng(1)
    for n in (1, 2, 3, 4):
        seq = rng.integers(0, 5, 60).tolist()
        grams = NGrams(n, seq[:3])
        for t in range(3, len(seq)):
            tail = tuple(seq[t - n + 1:t]) if n > 1 else ()
            want = [] if t + 1 < n else sorted({seq[i + n - 1] for i in range(t - n + 1) if tuple(seq[i:i + n - 1]) == tail})
            assert sorted(grams.banned()) == want, (n, t)
            grams.add(seq[t])


def test_greedy_ids_equal_transformers_generate(transformers_run):
    runs = transformers_run["generate"]
    for run in runs:
        assert run["ours"] == run["ref"], run
    # the cases are not vacuous: some runs stop at an eos of the list (not the first), one only after min_new_tokens
    # although an eos of the list was the argmax before (the same prompt with eos [2] runs on with that id)
    assert any(run["stop"] == "eos" and run["ref"][-1] != 2 for run in runs) and any(run["stop"] == "length" for run in runs)
    short = [run for run in runs if run["kw"].get("min_new_tokens")]
    masked = [i for i, t in enumerate(short[0]["ref"][:12]) if t in short[1]["eos"]]
    assert masked and short[1]["stop"] == "eos" and len(short[1]["ref"]) > 12
    plain = [run["ref"] for run in runs if run["kw"]["repetition_penalty"] == 1.0 and "no_repeat_ngram_size" not in run["kw"]]
    assert any(len(set(r)) < len(r) / 2 for r in plain)  # without a penalty the tiny model loops
    # ... and with the n-gram ban on the same prompt it does not repeat a bigram
    banned = next(run["ref"] for run in runs if run["kw"].get("no_repeat_ngram_size") == 2)
    bigrams = list(zip([4, 4, 4, 4, 8] + banned, ([4, 4, 4, 4, 8] + banned)[1:]))[4:]
    assert len(set(bigrams)) == len(bigrams) and banned != plain[0]


def test_process_logits_min_new_tokens_masks_every_eos():
    logits = np.zeros((2, 8), dtype=np.float32)
    got = process_logits(logits, [], [3, 5], min_new_tokens=5, eos_ids=frozenset({2, 6}))
    assert np.isneginf(got[0, [2, 6]]).all() and np.isfinite(np.delete(got[0], [2, 6])).all()
    assert np.isfinite(got[1]).all()  # row 1 has 5 new tokens: no mask
    assert np.isfinite(logits).all()  # the input is not changed


def test_penalty_keeps_the_logits_dtype():
    logits = np.array([[1.5, -1.5, 3.0]], dtype=np.float16)
    got = process_logits(logits, [np.array([0, 1])], [0], repetition_penalty=1.5)
    assert got.dtype == np.float16 and got.tolist() == [[1.0, -2.25, 3.0]]


@pytest.mark.parametrize("kw, match", [
    (dict(repetition_penalty=0), r"repetition_penalty must be a number in \(0, 100\]"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(min_new_tokens=-1), "min_new_tokens must be an integer"),
    (dict(no_repeat_ngram_size=-2), "no_repeat_ngram_size must be an integer"),
    (dict(no_repeat_ngram_size=2.5), "no_repeat_ngram_size must be an integer"),
    (dict(eos_id="2"), "eos_id must be a token id or a list"),
    (dict(eos_id=[2, -1]), "eos_id must be an integer >= 0"),
])
def test_bad_controls_are_one_line_errors(kw, match):
    class Fake:
        vocab_size, tokenizer = 8, None

    with pytest.raises(RuntimeInputError, match=match):
        Generator(Fake(), [1, 2], **kw)
