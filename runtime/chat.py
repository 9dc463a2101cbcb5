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
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

from edgelin.errors import ManifestError, RuntimeInputError

CONFIG_FILE = "tokenizer_config.json"
ROLES = ("system", "user", "assistant", "tool")


def _jinja():
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        raise RuntimeInputError("chat templates need the jinja2 package: pip install 'jinja2>=3.1.6'") from None
    major, minor, patch = (int(x) for x in (jinja2.__version__.split(".") + ["0", "0"])[:3] if x.isdigit())
    if (major, minor, patch) < (3, 1, 6):
        raise RuntimeInputError(f"jinja2 {jinja2.__version__} has known sandbox escapes; chat templates are code from the checkpoint: pip install -U 'jinja2>=3.1.6'")
    return jinja2


def _environment():
    jinja2 = _jinja()

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (marks the assistant's part for training): renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: its text, or an object with ``content``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class ChatTemplate:
    """A checkpoint's chat template and the special tokens it is rendered with."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        if not isinstance(source, str) or not source:
            raise ManifestError(f"{CONFIG_FILE}: chat_template must be a non-empty text")
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        jinja2 = _jinja()
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ManifestError(f"{CONFIG_FILE}: the chat template does not parse ({exc.message}, line {exc.lineno}); re-export with a fixed tokenizer_config.json") from None

    @classmethod
    def of_config(cls, config: dict[str, Any], name: str = "default") -> "ChatTemplate | None":
        """From tokenizer_config.json's data: its ``chat_template`` (a text, or a list of {name, template}: the one
        named ``name``), None where it has none."""
        source = config.get("chat_template")
        if source is None:
            return None
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            if name not in named:
                raise RuntimeInputError(f"{CONFIG_FILE} has no chat template named {name!r}; it has {', '.join(map(str, named))}")
            source = named[name]
        special = {k: text for k, v in config.items() if k.endswith("_token") and (text := _token_text(v)) is not None}
        return cls(source, special)

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
        return cls.of_config(config) if isinstance(config, dict) else None

    def render(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True, **variables: Any) -> str:
        """The conversation as text, ending with the assistant's turn opened (``add_generation_prompt``)."""
        checked = check_messages(messages)
        jinja2 = _jinja()
        try:
            return self._template.render(messages=checked, add_generation_prompt=add_generation_prompt,
                                         **{**self.special_tokens, **variables})
        except jinja2.exceptions.TemplateError as exc:
            raise RuntimeInputError(f"the chat template refused the conversation: {exc}") from None


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """A list of {"role", "content"} messages with known roles and text content; a one-line error otherwise."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise RuntimeInputError("a conversation is a non-empty list of {'role': ..., 'content': ...} messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise RuntimeInputError(f"message {i} must be {{'role': one of {', '.join(ROLES)}, 'content': text}}, got {str(m)[:80]}")
    return [dict(m) for m in messages]


def encode_rendered(tokenizer, text: str) -> list[int]:
    """The ids of a rendered conversation: the template's text holds its own special tokens (its bos among them),
    so nothing is added (transformers' apply_chat_template(tokenize=True) encodes it the same way)."""
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
    return encode_rendered(tokenizer, template.render(messages, add_generation_prompt=True))


class Chat:
    """A conversation with an export that keeps the model's state between turns.

    Each turn renders the whole conversation with the chat template and feeds the model only the ids after those
    it has already seen (the previous prompts and replies, eos included); where the rendering of the past does not
    start with exactly those ids (a template that rewrites earlier turns, a reply that re-tokenizes differently),
    the conversation is prefilled again from a fresh state -- the same result, more work (``self.refills`` counts)."""

    def __init__(self, session, *, system: str | None = None, template: ChatTemplate | None = None) -> None:
        from edgelin.runtime.tokenizer import make_tokenizer

        self.session = session
        self.template = template or ChatTemplate.of_export(session.export_dir, session.manifest)
        if self.template is None:
            raise RuntimeInputError("this export's tokenizer has no chat template (tokenizer_config.json's chat_template); prompt it with plain text")
        self.tokenizer = make_tokenizer(session.manifest.tokenizer, session.export_dir, session.manifest.vocab_size)
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self.state = None
        self.fed: list[int] = []  # every id the state has seen
        self.refills = 0  # turns that prefilled the whole conversation again
        self.last_prefill = 0
        self.last_stats = None  # the last turn's generate timings (Stats: first_token_s, prefill_s, decode_tokens_per_s, ...)

    def prompt_ids(self, messages: Sequence[dict[str, Any]] | None = None) -> list[int]:
        """The ids of the conversation so far (or of ``messages``) with the assistant's turn opened."""
        return encode_rendered(self.tokenizer, self.template.render(self.messages if messages is None else messages, add_generation_prompt=True))

    def send(self, content: str, **options: Any) -> str:
        """The user's message -> the assistant's reply (Generator options: max_new_tokens, temperature, stop, ...)."""
        from edgelin.runtime.generate import Generator

        self.messages.append({"role": "user", "content": content})
        ids = self.prompt_ids()
        if self.state is None or ids[: len(self.fed)] != self.fed or len(ids) == len(self.fed):
            if self.state is not None:
                self.refills += 1
            self.state, self.fed = None, []
        new = ids[len(self.fed):]
        self.last_prefill = len(new)  # prompt tokens this turn fed the model
        gen = Generator(self.session, [new], state=self.state, **options).run()
        result, self.last_stats = gen.results[0], gen.stats
        self.state = gen.state
        self.fed = ids + result.ids + ([result.eos_id] if result.eos_id is not None else [])
        self.messages.append({"role": "assistant", "content": result.text})
        return result.text


__all__ = ["Chat", "ChatTemplate", "chat_ids", "check_messages", "encode_rendered"]
