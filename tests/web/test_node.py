"""The JavaScript runtime (runtime/web/edgelin.mjs) in node with onnxruntime-node, against the Python runtime.

Python writes the cases (prompts, its greedy ids, text and logits; tokenizer and sampler expectations)
to a JSON file; ``node --test tests/web/edgelin.test.mjs`` checks the module against them: greedy ids
equal, logits within 1e-4 (one ONNX Runtime thread on each side), on the bundled model's export, on a
cosFormer export (an int64 state), on a ragged export (its prefill graph takes per-row lengths, which
the module feeds) and on a hybrid export (a windowed KV cache: a state that grows, then stays at its window). Skipped, with the reason, where node or onnxruntime-node is missing.

The golden check (``Model.check()``) runs on each export against what the Python check
(``edgelin.runtime.golden.check``) measured there, and on copies of the bundled export whose golden.json
was changed: one value of one decode row moved by 1.0 with the manifest's golden entry updated (the check
must fail and name that row), and one changed behind the manifest's back (refused: its sha256 differs).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
TEST_FILE = ROOT / "tests" / "web" / "edgelin.test.mjs"

# (name, text, prefill piece): 1 token, a 17-byte prompt, multi-byte characters, a prompt longer than
# two pieces with a short last piece
PROMPTS = [
    ("one-token", "T", 1024),
    ("17-bytes", "The for statement", 1024),
    ("utf8", "Größe: 10 € — naïve", 4),
    ("pieces", "def f(x):\n    return x * 2\n" * 10, 129),
]


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _export_case(name, export_dir, python_greedy, n, prompts):
    from edgelin.runtime import Generator, load

    out = {"name": name, "dir": str(export_dir), "prompts": []}
    for pname, ids, piece in prompts:
        r = python_greedy(export_dir, ids, n, piece)
        out["prompts"].append({
            "name": pname, "ids": ids, "piece": piece, "greedy_ids": r["greedy_ids"], "text": r["text"],
            "prefill_logits": r["prefill_logits"].astype(float).tolist(),
            "decode_logits": [x.astype(float).tolist() for x in r["decode_logits"]],
        })
    s = load(export_dir, provider="cpu", threads=1)
    first, second = prompts[1][1], _bytes(" and then")
    g1 = Generator(s, [first], max_new_tokens=12).run()
    g2 = Generator(s, [second], state=g1.state, max_new_tokens=9).run()
    out["continuation"] = {"first_ids": first, "first_n": 12, "first_out": g1.results[0].ids,
                           "second_ids": second, "second_n": 9, "second_out": g2.results[0].ids}
    out["state_bytes"] = s.manifest.state_bytes(1)
    out["golden_check"] = _python_check(export_dir)
    return out


def _python_check(export_dir):
    """The Python golden check of ``export_dir`` on CPU: {passed, results: [{name, max_abs, ...}]}."""
    from edgelin.runtime.golden import check

    report = check(export_dir, ["cpu"], threads=1, timing=False).to_dict()
    assert report["golden"], f"{export_dir} has no golden outputs"
    return {"passed": report["passed"], "results": report["providers"][0]["results"]}


PERTURBED_ROW = ("decode", 1, 3)  # (graph, prompt, step) of the row whose stored value the perturbed copy moves


def _golden_cases(export_dir, tmp_path):
    """Copies of ``export_dir`` with a changed golden.json: "perturbed" (the largest stored logit of
    PERTURBED_ROW moved by +1.0, the manifest's golden sha256 and bytes updated: a valid file of wrong
    values) and "tampered" (one digit changed, the manifest left as it was: not the file it records)."""
    from edgelin.errors import ManifestError
    from edgelin.runtime.golden import GOLDEN_FILE, Golden, golden_text
    from edgelin.runtime.manifest import MANIFEST_FILE, Manifest, file_sha256

    perturbed = tmp_path / "perturbed"
    shutil.copytree(export_dir, perturbed)
    golden = json.loads((perturbed / GOLDEN_FILE).read_text())
    row = next(r for r in golden["rows"] if (r["graph"], r["batch"], r["at"]) == PERTURBED_ROW)
    row["values"][0] += 1.0
    (perturbed / GOLDEN_FILE).write_text(golden_text(golden), encoding="utf-8")
    manifest = json.loads((perturbed / MANIFEST_FILE).read_text())
    manifest["golden"] = dict(manifest["golden"], sha256=file_sha256(perturbed / GOLDEN_FILE), bytes=(perturbed / GOLDEN_FILE).stat().st_size)
    (perturbed / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    Manifest.load(perturbed)  # the graphs' hashes still hold: only the golden entry changed
    python = _python_check(perturbed)
    graph, b, step = PERTURBED_ROW
    where = f"{graph} step {step} of prompt {b}:"
    assert not python["passed"] and [x["where"][:len(where)] for x in python["results"]] == ["", where], python

    tampered = tmp_path / "tampered"
    shutil.copytree(export_dir, tampered)
    data = bytearray((tampered / GOLDEN_FILE).read_bytes())
    at = data.index(b'"values":[') + len(b'"values":[')
    while not chr(data[at]).isdigit():
        at += 1
    data[at] = ord("2") if data[at] == ord("1") else ord("1")  # the same size, still JSON: caught by its sha256 alone
    (tampered / GOLDEN_FILE).write_bytes(bytes(data))
    with pytest.raises(ManifestError, match="sha256 differs"):
        Golden.load(tampered, Manifest.load(tampered))
    return {"perturbed": {"dir": str(perturbed), "python": python, "where": where},
            "tampered": {"dir": str(tampered)}}


def _tokenizer_cases():
    from edgelin.runtime.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    streams = [
        _bytes("plain"), _bytes("€uro"), _bytes("😀!"),
        [0xE2, 0x82], [0xFF, 0x41], [0xE2, 0x41, 0x82, 0xAC], [0xF0, 0x9F, 0x98], [0xC0, 0xAF, 0x41], [0xED, 0xA0, 0x80],
    ]
    decoding = []
    for ids in streams:
        dec = tok.decoder()
        decoding.append({"ids": ids, "pieces": [dec.feed(i) for i in ids] + [dec.flush()]})
    encoding = [{"text": t, "ids": tok.encode(t).tolist()} for t in ("", "a", "Größe €", "😀")]
    return decoding, encoding


def _sampling_cases():
    """Logits, options and the Python sampler's probabilities: V = 256, and V = 65,536 / 250,000 with ties
    straddling the top-k and top-p cutoffs and banned (-inf, written as null) tokens."""
    from edgelin.runtime.sampling import Sampler, softmax

    rng = np.random.default_rng(0)
    cases = []

    def case(options, logits):
        sampler = Sampler(options["temperature"], options.get("topK", 0), options.get("topP", 1.0))
        written = [None if v == -np.inf else v for v in logits.astype(float).tolist()]
        cases.append({"options": options, "logits": written, "probs": sampler.probs(logits[None])[0].tolist()})

    for options in ({"temperature": 1.0}, {"temperature": 0.7, "topK": 5}, {"temperature": 1.3, "topP": 0.9},
                    {"temperature": 0.5, "topK": 40, "topP": 0.8}, {"temperature": 2.0, "topK": 1}, {"temperature": 1.0, "topP": 0.05}):
        logits = (rng.standard_normal(256) * 3).astype(np.float32)
        logits[7] = logits[9]  # a tie
        case(options, logits)
    # V = 250k: a nucleus of ~10k tokens (several candidate rounds), and top-k with top-p
    big = (rng.standard_normal(250_000) * 3).astype(np.float32)
    case({"temperature": 1.0, "topP": 0.9}, big)
    case({"temperature": 0.8, "topK": 50, "topP": 0.95}, big)
    # 3000 tied tokens below 4 leaders; top-k cuts inside the tie (all kept), top-p half way through it
    # (p midway between two tokens' cumulative mass, far from any rounding)
    tied = (rng.standard_normal(65_536) - 20).astype(np.float32)
    tied[1000:4000] = 1.0
    tied[[7, 60_000, 65_535, 5]] = [6.0, 5.0, 5.0, 4.0]
    probs = softmax(tied.astype(np.float64))
    p_mid = float(probs[[7, 60_000, 65_535, 5]].sum() + probs[1000] * 1500.5)
    case({"temperature": 1.0, "topK": 1000}, tied)
    case({"temperature": 1.0, "topP": p_mid}, tied)
    case({"temperature": 1.0, "topK": 10, "topP": p_mid}, tied)
    # most of a 250k vocabulary banned; the nucleus is everything that is not
    banned = np.full(250_000, -np.inf, dtype=np.float32)
    banned[:3000] = rng.standard_normal(3000).astype(np.float32)
    banned[[3, 99_999, 200_001]] = 2.0
    case({"temperature": 1.0, "topP": 0.999}, banned)
    case({"temperature": 0.9, "topK": 2, "topP": 0.5}, banned)
    return cases


@pytest.fixture(scope="module")
def ragged_export(exported):
    """The cosFormer test model (conv 4, an int64 position state) exported with a ragged prefill graph."""
    return exported("cosformer", options={"ragged": True})[1]


def test_the_javascript_runtime_matches_the_python_runtime(node, ort_node, bundled_export, exported, ragged_export, python_greedy, tmp_path):
    _, cos_dir = exported("cosformer")
    # a hybrid: layer 1 softmax attention with a KV cache of at most 16 positions (a growing state, "past")
    _, hybrid_dir = exported("elu+1", decay="scalar", attn_layers=(1,), attn_window=16)
    # a tied head read in place: Gemm with transB on the embedding (a vocabulary of 1,024: test_weights_file's export)
    _, gemm_dir = exported("elu+1", options={"precision": "fp32"}, vocab_size=1024)
    # a prefill graph that returns every position's logits (exports before logits_at): the runtime takes the last
    _, every_dir = exported("elu+1", options={"logits_at": False})
    from edgelin.runtime.manifest import Manifest

    assert any(s.dtype == "int64" for s in Manifest.load(cos_dir).states), "the cosFormer export should carry an int64 state"
    assert Manifest.load(ragged_export).lengths is not None and Manifest.load(cos_dir).lengths is None
    assert Manifest.load(every_dir).logits_at is None and Manifest.load(cos_dir).logits_at is not None
    prompts = [(n, _bytes(t), piece) for n, t, piece in PROMPTS]
    decoding, encoding = _tokenizer_cases()
    cases = {
        "exports": [
            _export_case("bundled", bundled_export, python_greedy, 40, prompts),
            _export_case("cosformer", cos_dir, python_greedy, 24, prompts),
            _export_case("cosformer-ragged", ragged_export, python_greedy, 24, prompts),
            _export_case("hybrid-window16", hybrid_dir, python_greedy, 24, prompts),
            _export_case("tied-head-gemm", gemm_dir, python_greedy, 24, prompts),
            _export_case("every-position-logits", every_dir, python_greedy, 24, prompts),
        ],
        "decoding": decoding, "encoding": encoding, "sampling": _sampling_cases(),
        "golden": _golden_cases(bundled_export, tmp_path),
    }
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(cases))
    env = dict(os.environ, EDGELIN_WEB_CASES=str(path), EDGELIN_ORT_NODE=str(ort_node))
    result = subprocess.run([node, "--test", "--test-reporter=spec", str(TEST_FILE)], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    report = result.stdout + result.stderr
    assert result.returncode == 0, report[-6000:]
    # every test ran: none was skipped, none was silently empty
    counts = {k: int(v) for k, v in re.findall(r"ℹ (pass|fail|skipped|tests) (\d+)", report)}
    assert counts.get("fail") == 0 and counts.get("skipped") == 0 and counts.get("pass", 0) >= 6, report[-3000:]


def test_without_cases_node_skips_and_says_why(node):
    """The node file run alone (no cases) skips its runtime tests and names the reason."""
    env = {k: v for k, v in os.environ.items() if k not in ("EDGELIN_WEB_CASES", "EDGELIN_ORT_NODE")}
    result = subprocess.run([node, "--test", "--test-reporter=spec", str(TEST_FILE)], capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "EDGELIN_WEB_CASES is not set" in result.stdout


@pytest.mark.parametrize("runtime", ["node", "wasm"])
def test_the_llamacpp_sections_javascript_round_times_an_export(runtime, node, ort_node, ort_web, bundled_export):
    """scripts/llamacpp_round.mjs, the bench's llamacpp section's measurement in the JavaScript runtimes: decode
    tokens/s over N calls and prefill tokens/s of one call per length, from the export in node_modules' ONNX Runtime."""
    from edgelin.bench import llamacpp
    from edgelin.bench.lowering import JS_PACKAGES

    if not (ROOT / "node_modules" / JS_PACKAGES[runtime]).is_dir():
        pytest.skip(f"the bench runs the checkout's node_modules/{JS_PACKAGES[runtime]}")
    got = llamacpp.js_round(runtime, bundled_export, 1, 4, (16, 40))
    assert set(got) == {"tg4", "pp16", "pp40"}, got
    assert all(value > 0 and np.isfinite(value) for value in got.values()), got
    # a measurement that throws loses only its own figure: an empty prompt, which the runtime refuses
    got = llamacpp.js_round(runtime, bundled_export, 1, 4, (0, 16))
    assert set(got) == {"tg4", "pp16", "failed"} and set(got["failed"]) == {"pp0"}, got
    assert "prefill takes at least" in got["failed"]["pp0"] and got["pp16"] > 0 and got["tg4"] > 0
