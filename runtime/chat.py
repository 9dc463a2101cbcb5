"""Chat templates: a conversation rendered as the checkpoint's tokenizer_config.json says, and kept between turns.

    template = ChatTemplate.of_export("out/")                   # None where the export has no chat template
    text = template.render([{"role": "user", "content": "Hi"}])  # = transformers' apply_chat_template(tokenize=False,
                                                                 #   add_generation_prompt=True) on the same messages
    chat = Chat(session)                                         # a conversation that keeps its state
    reply = chat.send("Hi", max_new_tokens=64)                   # each turn prefills only its new tokens

A chat template is Jinja2 code from the checkpoint: it is rendered in Jinja2's immutable sandbox (as transformers
renders it: trim_blocks, lstrip_blocks, the loop controls, ``raise_exception``, ``strftime_now``, a ``tojson`` that
keeps non-ASCII text, the ``{% generation %}`` tag), with the tokenizer's special tokens (``bos_token``,
``eos_token``, ...) as variables. Torch-free: needs ``jinja2`` (>= 3.1.6) beside ``tokenizers``.

Like any untrusted code it runs within bounds (``RenderLimits``, edgelin.runtime.sandbox: time, size, call depth);
whatever fails (a refusal, a bound, the template's own error) is one ``ChatTemplateError`` line naming the template.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Sequence

from edgelin.errors import ManifestError, RuntimeInputError
from edgelin.runtime.sandbox import BUDGET, Budget, Exceeded, RenderLimits, environment, jinja, measure


CONFIG_FILE = "tokenizer_config.json"


ROLES = ("system", "user", "assistant", "tool")


class ChatTemplateError(RuntimeInputError):
    """A chat template failed on a conversation: it refused it (``raise_exception``), ran past its bounds
    (``RenderLimits``) or broke; the message names the template."""


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: its text, or an object with ``content``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class ChatTemplate:
    """A checkpoint's chat template and the special tokens it is rendered with.

    ``origin`` names the template in messages (default: tokenizer_config.json); ``limits`` bounds each rendering
    (``RenderLimits``: time, size, nesting): a template that runs past them, or fails in any other way, is a
    ``ChatTemplateError`` of one line."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, *, origin: str | None = None,
                 limits: RenderLimits | None = None) -> None:
        self.origin = f"the chat template of {CONFIG_FILE}" if origin is None else str(origin)
        if not isinstance(source, str) or not source:
            raise ManifestError(f"{CONFIG_FILE}: chat_template must be a non-empty text ({self.origin})")
        if special_tokens is not None and not isinstance(special_tokens, Mapping):
            raise RuntimeInputError(f"special_tokens must be a dict of names to texts, got {type(special_tokens).__name__}")
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.limits = limits or RenderLimits()
        jinja2 = jinja()
        token = BUDGET.set(Budget(self.limits, len(source)))  # compiling evaluates constant output
        try:
            self._template = environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ManifestError(f"{CONFIG_FILE}: the chat template does not parse ({exc.message}, line {exc.lineno}; "
                                f"{self.origin}); re-export with a fixed tokenizer_config.json") from None
        except (Exceeded, RecursionError, MemoryError) as exc:  # a template nested past what the compiler can take
            raise ManifestError(f"{self.origin} cannot be compiled ({_one_line(exc)}); re-export with a fixed tokenizer_config.json") from None
        finally:
            BUDGET.reset(token)

    @classmethod
    def of_config(cls, config: dict[str, Any], name: str = "default", *, origin: str | None = None) -> "ChatTemplate | None":
        """From tokenizer_config.json's data: its ``chat_template`` (a text, or a list of {name, template}: the one
        named ``name``), None where it has none."""
        if not isinstance(config, Mapping):
            raise RuntimeInputError(f"a tokenizer config is a dict (tokenizer_config.json's data), got {type(config).__name__}")
        origin = f"the chat template of {origin or CONFIG_FILE}"
        source = config.get("chat_template")
        if source is None:
            return None
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            if name not in named:
                raise RuntimeInputError(f"{CONFIG_FILE} has no chat template named {name!r}; it has {', '.join(map(str, named))}")
            source, origin = named[name], f"{origin} named {name!r}"
        special = {k: text for k, v in config.items() if k.endswith("_token") and (text := _token_text(v)) is not None}
        return cls(source, special, origin=origin)

    @classmethod
    def of_export(cls, export_dir: str | os.PathLike, manifest=None) -> "ChatTemplate | None":
        """The chat template of an export's tokenizer (its tokenizer_config.json, checked against the manifest's
        sha256); None where the export has none."""
        from edgelin.runtime.manifest import Manifest, file_sha256

        manifest = manifest or Manifest.load(export_dir)
        files = (manifest.tokenizer or {}).get("files") or {}
        if CONFIG_FILE not in files:
            return None
        path = Path(export_dir) / CONFIG_FILE
        if not path.is_file() or file_sha256(path) != files[CONFIG_FILE]:
            raise ManifestError(f"{path} is missing or is not the file edgelin.json describes (its sha256 differs); re-export the model")
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ManifestError(f"{path} is not JSON ({exc}); re-export the model") from None
        return cls.of_config(config, origin=str(path)) if isinstance(config, dict) else None

    def render(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True, **variables: Any) -> str:
        """The conversation as text, ending with the assistant's turn opened (``add_generation_prompt``).

        Bounded by ``self.limits``; any failure of the template is a ChatTemplateError naming it."""
        checked = check_messages(messages)
        jinja2 = jinja()
        values = {**self.special_tokens, **variables, "messages": checked, "add_generation_prompt": add_generation_prompt}
        budget = Budget(self.limits, measure(values, 1 << 62)[0])
        token = BUDGET.set(budget)
        try:
            pieces, n = [], 0
            render = self._template.root_render_func(self._template.new_context(values))
            try:
                for piece in render:
                    n += len(piece)
                    budget.fits(n, "a conversation's text")
                    pieces.append(piece)
            finally:
                render.close()
            text = "".join(pieces)
        except Exceeded as exc:
            raise ChatTemplateError(f"{self.origin} ran past its bounds: {exc}; it is code from the checkpoint -- fix its "
                                    "chat_template (tokenizer_config.json) and re-export, or prompt with plain text") from None
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused the conversation: {_one_line(exc)} ({self.origin})") from None
        except Exception as exc:  # any other failure of the template's code (RecursionError, OverflowError, ...)
            raise ChatTemplateError(f"{self.origin} failed on this conversation ({type(exc).__name__}: {_one_line(exc)}); "
                                    "fix its chat_template (tokenizer_config.json) and re-export, or prompt with plain text") from None
        finally:
            BUDGET.reset(token)
        at = _surrogate_at(text)
        if at is not None:
            raise ChatTemplateError(f"{self.origin} rendered a lone surrogate {text[at]!r} at character {at}, which is not text; "
                                    "fix its chat_template (tokenizer_config.json) and re-export")
        return text

    def ids(self, tokenizer, messages: Sequence[dict[str, Any]]) -> list[int]:
        """The ids of ``messages`` rendered, the assistant's turn opened; an error where the template renders nothing
        (there would be nothing to prompt the model with)."""
        ids = encode_rendered(tokenizer, self.render(messages, add_generation_prompt=True))
        if not ids:
            raise ChatTemplateError(f"{self.origin} rendered nothing for this conversation, so there is nothing to prompt the "
                                    "model with; fix its chat_template (tokenizer_config.json) and re-export, or prompt with plain text")
        return ids


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__


def _surrogate_at(text: str) -> int | None:
    """Where ``text`` holds a lone surrogate (no text: UTF-8 cannot hold it), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """A list of {"role", "content"} messages with known roles and text content; a one-line error otherwise."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise RuntimeInputError("a conversation is a non-empty list of {'role': ..., 'content': ...} messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise RuntimeInputError(f"message {i} must be {{'role': one of {', '.join(ROLES)}, 'content': text}}, got {str(m)[:80]}")
        at = _surrogate_at(m["content"])
        if at is not None:
            raise RuntimeInputError(f"message {i}'s content holds a lone surrogate {m['content'][at]!r} at character {at}, "
                                    "which is not text; pass valid Unicode text")
    return [dict(m) for m in messages]


def encode_rendered(tokenizer, text: str) -> list[int]:
    """The ids of a rendered conversation: the template's text holds its own special tokens (its bos among them),
    so nothing is added (transformers' apply_chat_template(tokenize=True) encodes it the same way)."""
    if not isinstance(text, str):
        raise RuntimeInputError(f"a rendered conversation is text (str), got {type(text).__name__}")
    at = _surrogate_at(text)
    if at is not None:
        raise RuntimeInputError(f"the text holds a lone surrogate {text[at]!r} at character {at}, which is not text; pass valid Unicode text")
    return tokenizer.tokenizer.encode(text, add_special_tokens=False).ids


def chat_ids(export_dir: str | os.PathLike, messages: Sequence[dict[str, Any]], manifest=None) -> list[int]:
    """The ids of ``messages`` rendered with the export's chat template, the assistant's turn opened."""
    from edgelin.runtime.manifest import Manifest
    from edgelin.runtime.tokenizer import make_tokenizer

    manifest = manifest or Manifest.load(export_dir)
    template = ChatTemplate.of_export(export_dir, manifest)
    if template is None:
        raise RuntimeInputError("this export's tokenizer has no chat template (tokenizer_config.json's chat_template); prompt it with plain text")
    tokenizer = make_tokenizer(manifest.tokenizer, export_dir, manifest.vocab_size)
    return template.ids(tokenizer, messages)


class Chat:
    """A conversation with an export that keeps the model's state between turns.

    Each turn renders the whole conversation with the chat template and feeds the model only the ids after those
    it has already seen (the previous prompts and replies, eos included); where the rendering of the past does not
    start with exactly those ids (a template that rewrites earlier turns, a reply that re-tokenizes differently),
    the conversation is prefilled again from a fresh state -- the same result, more work (``self.refills`` counts)."""

    def __init__(self, session, *, system: str | None = None, template: ChatTemplate | None = None) -> None:
        from edgelin.runtime.tokenizer import make_tokenizer

        if not hasattr(session, "manifest") or not hasattr(session, "export_dir"):
            raise RuntimeInputError(f"Chat takes a Session (edgelin.runtime.load(export_dir)), got {type(session).__name__}")
        if template is not None and not isinstance(template, ChatTemplate):
            raise RuntimeInputError(f"template must be a ChatTemplate, got {type(template).__name__}")
        self.session = session
        self.template = template or ChatTemplate.of_export(session.export_dir, session.manifest)
        if self.template is None:
            raise RuntimeInputError("this export's tokenizer has no chat template (tokenizer_config.json's chat_template); prompt it with plain text")
        if system is not None:
            check_messages([{"role": "system", "content": system}])  # text, else every later turn would fail on it
        self.tokenizer = make_tokenizer(session.manifest.tokenizer, session.export_dir, session.manifest.vocab_size)
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self.state = None
        self.fed: list[int] = []  # every id the state has seen
        self.refills = 0  # turns that prefilled the whole conversation again
        self.last_prefill = 0
        self.last_stats = None  # the last turn's generate timings (Stats: first_token_s, prefill_s, decode_tokens_per_s, ...)

    def prompt_ids(self, messages: Sequence[dict[str, Any]] | None = None) -> list[int]:
        """The ids of the conversation so far (or of ``messages``) with the assistant's turn opened."""
        return self.template.ids(self.tokenizer, self.messages if messages is None else messages)

    def send(self, content: str, **options: Any) -> str:
        """The user's message -> the assistant's reply (Generator options: max_new_tokens, temperature, stop, ...).

        A refused turn (bad content or options, a template that fails, a prompt past the model's context, an
        interrupted generation) leaves the conversation as it was: the message is recorded only with its reply."""
        from edgelin.runtime.generate import Generator

        messages = check_messages(self.messages + [{"role": "user", "content": content}])
        ids = self.template.ids(self.tokenizer, messages)
        fresh = self.state is None or ids[: len(self.fed)] != self.fed or len(ids) == len(self.fed)
        state, fed = (None, []) if fresh else (self.state, self.fed)
        new = ids[len(fed):]
        gen = Generator(self.session, [new], state=state, **options)  # checks the options and ids; the state is untouched
        try:
            gen.run()
            after = gen.state
        except BaseException:
            if state is not None:  # the state went partly through this turn: the next one prefills the conversation anew
                self.state, self.fed = None, []
            raise
        result = gen.results[0]
        if fresh and self.state is not None:
            self.refills += 1
        self.state, self.last_stats, self.last_prefill = after, gen.stats, len(new)  # last_prefill: prompt tokens fed this turn
        self.fed = ids + result.ids + ([result.eos_id] if result.eos_id is not None else [])
        self.messages = messages + [{"role": "assistant", "content": result.text}]
        return result.text


__all__ = ["Chat", "ChatTemplate", "ChatTemplateError", "RenderLimits", "chat_ids", "check_messages", "encode_rendered"]
