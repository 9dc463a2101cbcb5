"""Chat templates and conversations of the chat tests (tests/tokenizers): transformers renders them the same."""

from __future__ import annotations

CHATML = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are helpful."
    "<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}{% set rest = messages[1:] %}"
    "{% else %}{% set system = false %}{% set rest = messages %}{% endif %}"
    "{% for message in rest %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "{% if loop.index0 == 0 and system %}{% set content = '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% if loop.index0 > 8 %}{% break %}{% endif %}{% endfor %}"
)
TOOLISH = (
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{% if m.role == 'assistant' %}{% generation %}A{{ ns.n }}: {{ m.content }}{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ m.role | upper }}{{ ns.n }}: {{ {'text': m.content} | tojson }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}A{{ ns.n + 1 }}: {% endif %}"
)
TEMPLATES = {"chatml": CHATML, "llama2": LLAMA2, "toolish": [{"name": "default", "template": TOOLISH}, {"name": "other", "template": "x"}]}
CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Be brief. Ünïcödé 漢字 😀"}, {"role": "user", "content": "  What is a stack?  "},
     {"role": "assistant", "content": "A LIFO list."}, {"role": "user", "content": "And a queue? \"quoted\" <b>"}],
]


def with_template(export, out, source):
    """A copy of ``export`` at ``out`` whose tokenizer_config.json carries the chat template ``source`` (the
    manifest's sha256 of it updated: the graphs are the export's own)."""
    import json
    import shutil

    from edgelin.runtime.manifest import MANIFEST_FILE, file_sha256

    shutil.copytree(export, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = source
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    manifest["tokenizer"]["files"]["tokenizer_config.json"] = file_sha256(out / "tokenizer_config.json")
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return out
