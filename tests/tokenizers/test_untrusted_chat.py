"""A conversation (edgelin.runtime.Chat, `edgelin generate --chat`) with a chat template that fails or a turn that is
refused: the conversation stays as it was, and the user reads one line naming the template."""

from __future__ import annotations

import copy

import pytest
from click.testing import CliRunner

from edgelin.errors import EdgelinError

from testkit.chat import CHATML, with_template

REFUSES_BAD = "{% for m in messages %}{% if m.content == 'bad' %}{{ raise_exception('no bad words') }}{% endif %}{% endfor %}" + CHATML


def _with_template(chat_export, tmp_path, source: str):
    return with_template(chat_export, tmp_path / "templated", source)


def _reply_from_scratch(session, chat, n):
    """The reply to the conversation so far (its last message the user's), generated from a fresh state."""
    from edgelin.runtime import Generator

    return Generator(session, [chat.prompt_ids()], max_new_tokens=n).run().text


def test_a_refused_send_leaves_the_conversation_as_it_was(chat_export):
    """Each refusal appended the user's message before: the next turn then went to the model with it, or failed."""
    from edgelin.runtime import Chat, ChatTemplate, load

    session = load(chat_export, provider="cpu", threads=1)
    chat = Chat(session, system="Be brief.", template=ChatTemplate(REFUSES_BAD))
    chat.send("Hello", max_new_tokens=4)
    before = copy.deepcopy(chat.messages), list(chat.fed), chat.state
    for content, options in (
        (None, {}), (5, {}), ("a \ud800", {}),  # no text
        ("bad", {}),  # the template refuses it
        ("fine", {"max_new_tokens": -1}), ("fine", {"stop": [""]}), ("fine", {"temperature": None}),  # bad options
    ):
        with pytest.raises(EdgelinError):
            chat.send(content, **options)
        assert (chat.messages, chat.fed, chat.state) == before, (content, options)
    chat.messages.append({"role": "user", "content": "Next?"})
    want = _reply_from_scratch(session, chat, 5)
    chat.messages.pop()
    assert chat.send("Next?", max_new_tokens=5) == want
    assert [m["content"] for m in chat.messages] == ["Be brief.", "Hello", chat.messages[2]["content"], "Next?", want]


def test_an_interrupted_send_leaves_the_conversation_and_the_next_turn_starts_afresh(chat_export, monkeypatch):
    """The state went partly through the interrupted turn: it is dropped, the next turn prefills the conversation.
    (The first reply is empty, so the second turn continues the state: see test_chat.py.)"""
    from edgelin.runtime import Chat, load

    session = load(chat_export, provider="cpu", threads=1)
    chat = Chat(session)
    chat.send("Hello", max_new_tokens=0)
    before = copy.deepcopy(chat.messages)
    assert chat.state is not None and chat.prompt_ids(before + [{"role": "user", "content": "And then?"}])[: len(chat.fed)] == chat.fed
    decode = session.decode

    def interrupted(*args, **kwargs):
        monkeypatch.setattr(session, "decode", decode)
        raise KeyboardInterrupt

    monkeypatch.setattr(session, "decode", interrupted)
    with pytest.raises(KeyboardInterrupt):
        chat.send("And then?", max_new_tokens=4)
    assert chat.messages == before and chat.state is None
    chat.messages.append({"role": "user", "content": "And then?"})
    want = _reply_from_scratch(session, chat, 4)
    chat.messages.pop()
    assert chat.send("And then?", max_new_tokens=4) == want and chat.last_prefill == len(chat.prompt_ids(chat.messages[:-1]))


def test_a_system_message_that_is_no_text_is_refused_at_once(chat_export):
    """It was kept, and every later turn failed on it."""
    from edgelin.runtime import Chat, load

    session = load(chat_export, provider="cpu", threads=1)
    for system in (5, ["Be brief."], "\ud800"):
        with pytest.raises(EdgelinError, match="message 0"):
            Chat(session, system=system)


@pytest.mark.parametrize("source, prompt, match", [
    ("{% if false %}x{% endif %}", "Hi", "rendered nothing for this conversation"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "Hi", "nest more than 64 deep"),
    ("{{ 'x' * 10**13 }}", "Hi", "would build a repeated text"),
    ("{{ range(10**12) | list }}", "Hi", "OverflowError"),
    (CHATML, "Hi \udcff there", "--prompt holds bytes that are not UTF-8"),
], ids=["renders-nothing", "recursion", "memory", "range", "surrogate"])
def test_cli_chat_with_a_failing_template_is_one_line(chat_export, tmp_path, source, prompt, match):
    """Before: "prompt_ids must be a non-empty list" for a user who passed --prompt, RecursionError, MemoryError and
    OverflowError tracebacks, the tokenizers package's TypeError."""
    from edgelin.cli.generate import generate

    export = _with_template(chat_export, tmp_path, source)
    result = CliRunner().invoke(generate, [str(export), "--chat", "-p", prompt, "-n", "2", "--provider", "cpu"])
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgelin: error: ") and match in lines[0], result.stderr
    if "surrogate" not in match and "UTF-8" not in match:
        assert str(export / "tokenizer_config.json") in lines[0]  # the template is named
