"""Chat templates (edgelin.runtime.chat) against transformers' apply_chat_template, and a conversation that keeps
its state between turns against prefilling the whole conversation each turn.

Templates: ChatML (Qwen's shape: a default system message, tojson-free), a Llama-2-style one (bos in the text,
raise_exception on roles out of order, loop controls), and one using tojson, namespace, a {% generation %} block
and a list of named templates. The oracle: transformers' PreTrainedTokenizerFast over the same tokenizer.json with
the same tokenizer_config.json, apply_chat_template(tokenize=False / True, add_generation_prompt=True).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edgelin.errors import RuntimeInputError

from testkit.chat import CONVERSATIONS, TEMPLATES


def _folder(hf_tokenizer, tmp_path, name: str) -> Path:
    """The byte-level tokenizer with a tokenizer_config.json that carries the chat template ``name``."""
    folder = tmp_path / name
    shutil.copytree(hf_tokenizer("bytelevel"), folder)
    config = {"bos_token": "<|end|>", "eos_token": "<|endoftext|>", "chat_template": TEMPLATES[name], "model_max_length": 1024}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _transformers(folder: Path, conversations) -> list[tuple[str, list[int]]]:
    """transformers' apply_chat_template of each conversation (text and ids), in a subprocess (fla and triton hidden)."""
    code = (
        "import sys, json; sys.modules['fla'] = None; sys.modules['triton'] = None\n"
        "from transformers import AutoTokenizer\n"
        f"tok = AutoTokenizer.from_pretrained({str(folder)!r})\n"
        f"convs = json.loads({json.dumps(json.dumps(conversations))})\n"
        "out = [(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True),"
        " list(tok.apply_chat_template(c, tokenize=True, add_generation_prompt=True, return_dict=True)['input_ids'])) for c in convs]\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [tuple(x) for x in json.loads(done.stdout.strip().splitlines()[-1])]


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_rendering_equals_transformers_apply_chat_template(name, hf_tokenizer, tmp_path):
    pytest.importorskip("transformers", reason="transformers is the oracle: pip install -e '.[test]'")
    from edgelin.runtime.chat import ChatTemplate, encode_rendered
    from edgelin.runtime.tokenizer import HuggingFaceTokenizer

    folder = _folder(hf_tokenizer, tmp_path, name)
    template = ChatTemplate.of_config(json.loads((folder / "tokenizer_config.json").read_text()))
    tok = HuggingFaceTokenizer.from_file(folder / "tokenizer.json", vocab_size=512)
    for conversation, (text, ids) in zip(CONVERSATIONS, _transformers(folder, CONVERSATIONS)):
        mine = template.render(conversation)
        assert mine == text
        assert encode_rendered(tok, mine) == ids


def test_a_template_that_refuses_a_conversation_says_why(hf_tokenizer, tmp_path):
    from edgelin.runtime.chat import ChatTemplate

    template = ChatTemplate.of_config(json.loads((_folder(hf_tokenizer, tmp_path, "llama2") / "tokenizer_config.json").read_text()))
    with pytest.raises(RuntimeInputError, match="the chat template refused the conversation: roles must alternate"):
        template.render([{"role": "assistant", "content": "hi"}])
    with pytest.raises(RuntimeInputError, match="message 0 must be"):
        template.render([{"role": "robot", "content": "hi"}])
    with pytest.raises(RuntimeInputError, match="no chat template named 'nope'"):
        ChatTemplate.of_config({"chat_template": TEMPLATES["toolish"]}, name="nope")


def test_the_sandbox_holds(hf_tokenizer):
    """A chat template is code from a checkpoint: it runs in Jinja2's immutable sandbox."""
    from edgelin.runtime.chat import ChatTemplate

    escape = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(RuntimeInputError, match="refused the conversation"):
        escape.render(CONVERSATIONS[0])
    with pytest.raises(RuntimeInputError, match="refused the conversation"):
        ChatTemplate("{% set x = messages.append(1) %}").render(CONVERSATIONS[0])


def test_a_chat_keeps_its_state_and_equals_prefilling_the_whole_conversation(chat_export):
    """Each turn's reply equals generating from the whole rendered conversation on a fresh state. A turn whose
    rendering starts with every id the state has seen feeds only the rest: turn 1 follows an empty reply, whose
    rendering always does; the tiny model's later replies hold bytes that are no UTF-8 (U+FFFD), which re-encode
    as other ids, so those turns prefill the conversation again (counted in refills), with the same result."""
    from edgelin.runtime import Chat, Generator, load

    session = load(chat_export, provider="cpu", threads=1)
    chat = Chat(session, system="Be brief.")
    for turn, n in enumerate((0, 6, 6, 6)):
        refills = chat.refills
        reply = chat.send(f"Question {turn}: what next?", max_new_tokens=n)
        ids = chat.prompt_ids(chat.messages[:-1])  # the conversation this turn was asked with
        assert reply == Generator(session, [ids], max_new_tokens=n).run().text, turn
        if turn == 1:
            assert chat.refills == refills and chat.last_prefill < len(ids), (chat.last_prefill, len(ids))
        if turn == 0 or chat.refills > refills:  # a fresh state: the whole conversation went in
            assert chat.last_prefill == len(ids)
    assert [m["role"] for m in chat.messages] == ["system"] + ["user", "assistant"] * 4


def test_cli_chat_renders_the_users_message(chat_export):
    from edgelin.runtime import generate_text
    from edgelin.runtime.chat import chat_ids

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    want = generate_text(chat_export, prompt_ids=chat_ids(chat_export, messages), max_new_tokens=5, provider="cpu", threads=1)["text"]
    edgelin = str(Path(sys.executable).with_name("edgelin"))
    done = subprocess.run([edgelin, "generate", str(chat_export), "--chat", "-p", "Hi", "--system", "Be brief.", "-n", "5",
                           "--provider", "cpu", "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["text"] == want
    bad = subprocess.run([edgelin, "generate", str(chat_export), "--system", "x", "-p", "Hi"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--system goes with --chat" in bad.stderr and "Traceback" not in bad.stderr
