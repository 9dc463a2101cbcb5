"""The JavaScript runtime's Hugging Face tokenizer (runtime/web/edgelin.mjs, run by @huggingface/tokenizers in node)
against the Python runtime's (the `tokenizers` package), on the exports of the three tokenizers trained here.

Python writes the cases; ``node --test tests/tokenizers/tokenizer.test.mjs`` checks, per export: encoding texts (bos
prepended as the manifest says) gives the Python ids; streaming id sequences gives Python's pieces, token for token
(byte-level tokens that split a character, SentencePiece byte-fallback runs, skipped special tokens held back and
released as Python releases them); greedy generation from a text prompt gives Python's ids and text, stopping at the
same eos, with Hugging Face generate's controls (repetition penalty, min_new_tokens, a stop string) as the Python
runtime applies them; a tokenizer.json changed behind the manifest's back is refused; chat templates render as in Python
(= transformers) through @huggingface/jinja, and a four-turn chat gives Python's replies, refills and prefills. Then `edgelin web` ships the tokenizer and
@huggingface/tokenizers with the site, and headless Chromium generates Python's text from a text prompt.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from testkit.node import ROOT, executable, node_modules, npm_package

TEST_FILE = ROOT / "tests" / "tokenizers" / "tokenizer.test.mjs"
KINDS = ("bytelevel", "sentencepiece", "ascii")
TEXTS = ["Hello world, this is a test.", " leading space and  two", "Emoji 😀🦀👍🏽 and CJK 漢字かな한국어, e\u0301 café naïve.",
         "def f(x):\n\treturn x  # done\n", ""]
PROMPT, N = "The quick brown", 24
# Hugging Face generate's controls, as the Python runtime takes them; JS_NAMES: the JavaScript runtime's names
CONTROLS = [{}, {"repetition_penalty": 1.3}, {"repetition_penalty": 0.7, "min_new_tokens": 20}, {"min_new_tokens": N},
            {"no_repeat_ngram_size": 2}, {"no_repeat_ngram_size": 3, "repetition_penalty": 1.1}]
JS_NAMES = {"repetition_penalty": "repetitionPenalty", "min_new_tokens": "minNewTokens", "stop": "stop",
            "no_repeat_ngram_size": "noRepeatNgramSize"}


def _streams(tok, rng) -> list[list[int]]:
    """Id sequences to stream: the texts' ids, and random ids (special tokens and, for SentencePiece, runs of
    byte-fallback pieces that are not UTF-8 among them)."""
    out = [tok.encode(t).tolist() for t in TEXTS if t]
    return out + [rng.integers(0, tok.vocab_size, rng.integers(1, 40)).tolist() for _ in range(40)]


def _cases(hf_export, tmp_path) -> dict:
    from edgelin.runtime import generate_text, load
    from edgelin.runtime.tokenizer import make_tokenizer

    rng = np.random.default_rng(0)
    exports = []
    for kind in KINDS:
        out = hf_export(kind)
        session = load(out, provider="cpu", threads=1)
        tok = make_tokenizer(session.manifest.tokenizer, out, session.manifest.vocab_size)
        streams = []
        for ids in _streams(tok, rng):
            dec = tok.decoder()
            streams.append({"ids": ids, "pieces": [dec.feed(i) for i in ids] + [dec.flush()], "text": tok.decode(ids)})
        runs = []
        for options in CONTROLS:
            gen = generate_text(out, PROMPT, max_new_tokens=N, provider="cpu", threads=1, **options)
            runs.append({"options": {JS_NAMES[k]: v for k, v in options.items()}, "ids": gen["ids"], "text": gen["text"],
                         "stop": gen["stop_reason"]})
        # a stop string that this generation reaches: a piece of its text past the first few tokens (where that text
        # is whole characters: text ending in U+FFFD is held back until the end, where no stop string is looked for)
        plain = runs[0]["text"]
        if len(plain) > 12 and "\ufffd" not in plain[:11]:
            stop = plain[8:11]
            gen = generate_text(out, PROMPT, max_new_tokens=N, provider="cpu", threads=1, stop=[stop])
            assert gen["stop_reason"] == "stop"
            runs.append({"options": {"stop": [stop]}, "ids": gen["ids"], "text": gen["text"], "stop": gen["stop_reason"]})
        exports.append({"kind": kind, "dir": str(out), "encode": [{"text": t, "ids": tok.encode(t).tolist()} for t in TEXTS],
                        "streams": streams, "prompt": PROMPT, "n": N, "generate": runs})
    assert any("stop" in r["options"] for e in exports for r in e["generate"]), "no generation reached a stop string"
    return {"exports": exports}


def _chat_cases(chat_export) -> dict:
    """The chat templates' renderings (Python = transformers: test_chat.py) and a four-turn chat on the ChatML export."""
    from edgelin.runtime import Chat, load
    from edgelin.runtime.chat import ChatTemplate
    from testkit.chat import CONVERSATIONS, TEMPLATES

    templates = []
    for name, source in TEMPLATES.items():
        config = {"bos_token": "<|end|>", "eos_token": {"content": "<|endoftext|>"}, "chat_template": source}
        template = ChatTemplate.of_config(config)
        templates.append({"name": name, "config": config, "renders": [template.render(c) for c in CONVERSATIONS]})
    chat = Chat(load(chat_export, provider="cpu", threads=1), system="Be brief.")
    turns = []
    for turn, n in enumerate((0, 6, 6, 6)):
        reply = chat.send(f"Question {turn}: what next?", max_new_tokens=n)
        turns.append({"content": f"Question {turn}: what next?", "n": n, "reply": reply, "refills": chat.refills, "prefill": chat.last_prefill})
    return {"templates": templates, "conversations": CONVERSATIONS, "export": str(chat_export), "system": "Be brief.", "turns": turns}


def test_the_javascript_tokenizer_is_the_python_one(hf_export, chat_export, tmp_path):
    node = executable("node", "nodejs")
    ort_node = npm_package("onnxruntime-node")
    npm_package("@huggingface/tokenizers")
    npm_package("@huggingface/jinja")
    path = tmp_path / "cases.json"
    path.write_text(json.dumps({**_cases(hf_export, tmp_path), "chat": _chat_cases(chat_export)}))
    env = dict(os.environ, EDGELIN_TOKENIZER_CASES=str(path), EDGELIN_ORT_NODE=str(ort_node), EDGELIN_NODE_MODULES=str(node_modules()))
    result = subprocess.run([node, "--test", "--test-reporter=spec", str(TEST_FILE)], capture_output=True, text=True, env=env,
                            timeout=600, cwd=ROOT)
    report = result.stdout + result.stderr
    assert result.returncode == 0, report[-6000:]
    counts = {k: int(v) for k, v in re.findall(r"ℹ (pass|fail|skipped|tests) (\d+)", report)}
    assert counts.get("fail") == 0 and counts.get("skipped") == 0 and counts.get("pass", 0) >= 4, report[-3000:]


@pytest.mark.parametrize("kind", KINDS)
def test_the_site_ships_the_tokenizer_and_generates_pythons_text(kind, hf_export, tmp_path):
    """`edgelin web` copies tokenizer.json (and its companions) and @huggingface/tokenizers; the page, in headless
    Chromium, generates the Python runtime's text from a text prompt."""
    from edgelin.runtime import generate_text
    from edgelin.runtime.manifest import Manifest
    from edgelin.web import TOK_SITE, write_site

    ort_web = npm_package("onnxruntime-web")
    tokenizers_js = npm_package("@huggingface/tokenizers")
    out = hf_export(kind)
    site = write_site(out, tmp_path / "site", ort_web=ort_web, tokenizers_js=tokenizers_js).out_dir
    listed = Manifest.load(out).tokenizer["files"]
    assert (site / TOK_SITE).is_file() and all((site / "export" / name).read_bytes() == (out / name).read_bytes() for name in listed)
    chromium = executable("chromium", "chromium-browser", "google-chrome")
    sys.path.insert(0, str(ROOT / "tests" / "web"))
    try:
        from test_chromium import open_page  # the page driver of the browser tests
    finally:
        sys.path.remove(str(ROOT / "tests" / "web"))
    want = generate_text(out, PROMPT, max_new_tokens=N, provider="cpu", threads=1)["text"]
    report = open_page(chromium, site, {"prompt": PROMPT, "n": N}, tmp_path / "profile")
    assert report["state"] == "done", report["output"]
    assert report["output"] == want


def test_a_site_of_a_huggingface_export_needs_the_tokenizers_package(hf_export, tmp_path):
    from edgelin.errors import RuntimeInputError
    from edgelin.web import write_site

    ort_web = npm_package("onnxruntime-web")
    with pytest.raises(RuntimeInputError, match=r"@huggingface/tokenizers is not installed .*npm install @huggingface/tokenizers@0.2.0"):
        write_site(hf_export("ascii"), tmp_path / "site", ort_web=ort_web, tokenizers_js=tmp_path / "nowhere")
    assert not (tmp_path / "site").exists()


def test_a_site_refuses_a_changed_tokenizer_file(hf_export, tmp_path):
    import shutil

    from edgelin.errors import ManifestError
    from edgelin.web import write_site

    copy = tmp_path / "export"
    shutil.copytree(hf_export("ascii"), copy)
    (copy / "tokenizer.json").write_text((copy / "tokenizer.json").read_text().replace('"[EOS]"', '"[EOT]"'))
    with pytest.raises(ManifestError, match="tokenizer.json is not the file edgelin.json describes"):
        write_site(copy, tmp_path / "site", ort_web=npm_package("onnxruntime-web"), tokenizers_js=npm_package("@huggingface/tokenizers"))
    assert not (tmp_path / "site").exists()


