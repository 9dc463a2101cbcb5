"""Text and ids from outside: a chat template is code from a checkpoint, run within bounds of time, size and call
depth, failing in one line that names it; stop strings of any length cost time linear in them; prompts and token
ids that are not what they should be (bytes, None, an id past int64) are refused in one line saying so."""

from __future__ import annotations

import time

import numpy as np
import pytest

from edgelin.errors import EdgelinError

pytest.importorskip("jinja2")

CONVERSATION = [{"role": "user", "content": "Hello"}]

# templates that would run without end, take all the memory, blow the stack or the sandbox's own range check
RUNAWAY = {
    "recursive-macro": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "nest more than"),
    "recursive-loop": ("{% for m in messages recursive %}{{ loop(messages) }}{% endfor %}", "nest more than"),
    "repeat-text": ("{{ 'x' * 10**13 }}", "would build a repeated text"),
    "repeat-list": ("{{ ([1] * 10**10) | length }}", "would build a repeated text or list"),
    "big-power": ("{{ 7 ** (10 ** 9) }}", "integer of more than"),
    "printf-width": ("{{ '%999999999999s' % 'x' }}", "padded field"),
    "printf-star": ("{{ '%*s' % (10**12, 'x') }}", "padded field"),
    "format-width": ("{{ '{:>999999999999}'.format('x') }}", "padded field"),
    "format-nested-width": ("{{ '{:>{}}'.format('x', 10**12) }}", "padded field"),
    "format-filter": ("{{ '%999999999999d' | format(1) }}", "padded field"),
    "center-filter": ("{{ 'x' | center(10**12) }}", "centred text"),
    "center-method": ("{{ 'x'.center(10**12) }}", "center()"),
    "zfill-method": ("{{ '1'.zfill(10**12) }}", "zfill()"),
    "indent-filter": ("{{ ('a\\n' * 1000) | indent(10**9) }}", "indented text"),
    "replace-method": ("{{ ('a' * 1000).replace('a', 'b' * 100000) }}", "replaced text"),
    "replace-filter": ("{{ ('a' * 1000) | replace('', 'b' * 100000) }}", "replaced text"),
    "join-method": ("{{ ('b' * 100000).join(range(1000) | map('string')) }}", "joined text"),
    "join-filter": ("{{ range(100000) | join('b' * 100000) }}", "joined text"),
    "doubling": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
                 "joined text"),
    "doubling-plus": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "'+'"),
    "list-of-copies": ("{% set ns = namespace(l=['x' * 100000]) %}{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}{% endfor %}",
                       "'+'"),
    "str-of-copies": ("{{ ['x' * 100000] * 10 * 10 * 10 }}", "repeated text or list"),
    "tojson-indent": ("{{ [[[[1, 2, 3]]]] | tojson(indent=10**9) }}", "tojson text"),
    "wordwrap": ("{{ ('a ' * 10000) | wordwrap(1, wrapstring='x' * 100000) }}", "wrapped text"),
    "slice-filter": ("{{ [1] | slice(10**12) | list | length }}", "slice of that many lists"),
    "batch-filter": ("{{ [1] | batch(10**12, 0) | list | length }}", "batch of that many lists"),
    "sum-of-lists": ("{{ ([[0]] * 100000) | sum(start=[]) | length }}", "summing 100,000 sequences"),
    "to-bytes": ("{{ (1).to_bytes(10**12, 'big') }}", "bytes"),
    "lipsum-paragraphs": ("{{ lipsum(10**9) }}", "lipsum(n=1000000000)"),
    "lipsum-words": ("{{ lipsum(1, False, 10**9, 10**9 + 1) }}", "lipsum(min=1000000000)"),
    "output": ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "conversation's text"),
}


def _template(source: str, seconds: float = 5.0):
    from edgelin.runtime.chat import ChatTemplate, RenderLimits

    return ChatTemplate(source, {"bos_token": "<s>"}, origin="the chat template of test/tokenizer_config.json",
                        limits=RenderLimits(seconds=seconds))


@pytest.mark.parametrize("source, match", list(RUNAWAY.values()), ids=list(RUNAWAY))
def test_a_runaway_template_is_one_line_naming_it(source, match):
    """Each would end in RecursionError, MemoryError, OverflowError or a process killed or hung before. Refused
    before the runaway work: the CPU time this process spends (not the wall clock, which a loaded machine stretches)."""
    start = time.process_time()
    with pytest.raises(EdgelinError) as caught:
        _template(source).render(CONVERSATION)
    message = str(caught.value)
    assert "\n" not in message and "test/tokenizer_config.json" in message and match in message, message
    assert time.process_time() - start < 2.0


@pytest.mark.parametrize("source", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% set l = range(100000) | list %}{% for i in l %}{% for j in l %}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{% for i in range(100000) %}{{ i if n > 10**9 else '' }}{% endfor %}{% endmacro %}"
    "{% for i in range(100000) %}{{ f(i) }}{% endfor %}",
], ids=["nested-ranges", "nested-lists", "macro-in-loop"])
def test_a_template_that_runs_too_long_stops_at_its_time_bound(source):
    start = time.perf_counter()
    with pytest.raises(EdgelinError, match="took longer than 0.2 s to render"):
        _template(source, seconds=0.2).render(CONVERSATION)
    assert time.perf_counter() - start < 1.5


def test_the_bounds_follow_the_conversation_and_are_settable():
    """A long conversation may render to a long text (the bound grows with it), the same size made up from a short
    one is refused, and a smaller bound is kept."""
    from edgelin.runtime.chat import ChatTemplate, RenderLimits

    long = [{"role": "user", "content": "y" * 3_000_000}]
    assert len(ChatTemplate("{{ messages[0].content * 4 }}").render(long)) == 12_000_000
    with pytest.raises(EdgelinError, match="would build a repeated text"):
        ChatTemplate("{{ 'y' * 12000000 }}").render(CONVERSATION)
    assert len(ChatTemplate("{{ 'y' * 5000 }}").render(CONVERSATION)) == 5000
    with pytest.raises(EdgelinError, match="would build a repeated text"):
        ChatTemplate("{{ 'y' * 5000 }}", limits=RenderLimits(chars=1000)).render(CONVERSATION)


def test_a_failing_template_is_one_line_naming_it_whatever_fails():
    """Errors of the template's own code (not a refusal of the conversation) are ChatTemplateErrors too."""
    for source, match in (
        ("{{ range(10**12) | list }}", "OverflowError"),
        ("{{ 1 // 0 }}", "ZeroDivisionError"),
        ("{{ 'abc'.index('z') }}", "ValueError"),
    ):
        with pytest.raises(EdgelinError) as caught:
            _template(source).render(CONVERSATION)
        message = str(caught.value)
        assert "\n" not in message and "test/tokenizer_config.json" in message and match in message, message


def test_a_template_that_compiles_constants_is_bounded_while_it_compiles():
    """jinja2 evaluates constant output when it compiles a template: that runs the template's code too."""
    start = time.process_time()  # CPU time: the work done before the refusal
    template = _template("{{ 'x' | center(10**12) }}{{ 'y' * 10**13 }}")  # MemoryError in the constructor before
    with pytest.raises(EdgelinError, match="centred text"):
        template.render(CONVERSATION)
    assert time.process_time() - start < 2.0


def test_ordinary_templates_render_as_before():
    """The bounds change nothing for templates that stay within them: loops, macros, filters, formatting."""
    source = (
        "{% macro item(m) %}{{ m.role | upper }}: {{ m.content | trim }}{% endmacro %}"
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ item(m) }}"
        "{{ ' [%d/%s]' % (loop.index, messages | length) }}{{ '{:>3}'.format(ns.n) }}\n{% endfor %}"
        "{{ messages | map(attribute='role') | join(',') }} {{ {'k': messages[-1].content} | tojson }} {{ 2 ** 10 }}"
        "{{ 'ab' * 3 }}{{ range(3) | list }}{{ lipsum(1, False, 3, 4) | length > 0 }}"
    )
    messages = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi 漢字"}]
    assert _template(source).render(messages) == (
        "SYSTEM: Be brief. [1/2]  1\nUSER: Hi 漢字 [2/2]  2\n"
        'system,user {"k": "Hi 漢字"} 1024ababab[0, 1, 2]True'
    )


def test_a_lone_surrogate_in_a_message_is_refused_in_one_line():
    """The plain prompt was refused so; a chat message went on to the tokenizer (TypeError) before."""
    with pytest.raises(EdgelinError, match=r"message 1's content holds a lone surrogate '\\ud800' at character 2"):
        _template("{{ messages[0].content }}").render([{"role": "system", "content": "ok"}, {"role": "user", "content": "ab\ud800"}])
    with pytest.raises(EdgelinError, match="rendered a lone surrogate"):
        _template("{{ '\\ud800' }}{{ messages[0].content }}").render(CONVERSATION)


def _byte_level_tokenizer():
    tk = pytest.importorskip("tokenizers")
    from edgelin.runtime.tokenizer import HuggingFaceTokenizer

    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    tok.train_from_iterator(["hello world"], tk.trainers.BpeTrainer(vocab_size=260, initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet()))
    return HuggingFaceTokenizer(tok, vocab_size=512)


def test_encoding_a_rendering_with_a_lone_surrogate_is_one_line():
    from edgelin.runtime.chat import encode_rendered

    with pytest.raises(EdgelinError, match="lone surrogate"):
        encode_rendered(_byte_level_tokenizer(), "hi \udcff")  # the tokenizers package's TypeError before


# ---- stop strings ------------------------------------------------------------------------------------------
def test_a_long_stop_string_costs_work_linear_in_it(session):
    """A 200,000-character stop string: each token compared every start of it with the held text (about 2e10
    character copies a token) before; now one table and one state. The work is counted, not timed: every read of
    the stop string's characters, which must stay within a few per character of it and of the text. The result is
    the same: the text ends exactly before the first stop string of the list found."""
    from edgelin.runtime import Generator
    from edgelin.runtime.controls import StopStrings

    class Counted(str):
        reads = 0

        def __getitem__(self, key):
            Counted.reads += 1
            return str.__getitem__(self, key)

    full = Generator(session, "Hello", max_new_tokens=40).run().text
    assert len(full) > 30
    never = "\x00" + full[:5] * 40_000  # long, and its start is text the model writes
    matcher = StopStrings([Counted(never)]).matcher()
    for i in range(0, len(full), 3):  # the text in pieces, as tokens arrive
        assert matcher.feed(full[i:i + 3]) is None
    assert Counted.reads <= 3 * len(never) + 4 * len(full), Counted.reads
    gen = Generator(session, "Hello", max_new_tokens=40, stop=[never, full[20:23]]).run()
    assert gen.results[0].stop_reason == "stop" and gen.results[0].text == full[: full.find(full[20:23])]


def test_stop_strings_end_the_text_where_a_search_of_the_held_text_does():
    """Pieces of text cut anywhere: after each piece, the text ends before the first occurrence of the first stop
    string (in the list's order) that the text not yet released holds -- the search the runtime made before, in
    quadratic time, and the JavaScript runtime makes; what is released is never part of a stop string."""
    import random

    from edgelin.runtime.controls import StopStrings

    def search(stops, pieces):
        held, out = "", ""
        for piece in pieces:
            held += piece
            for s in stops:
                if s in held:
                    return out + held[: held.find(s)]
            keep = max((k for s in stops for k in range(1, len(s)) if held.endswith(s[:k])), default=0)
            out, held = out + held[: len(held) - keep], held[len(held) - keep:]
        return None

    rng = random.Random(0)
    for trial in range(3000):
        alphabet = "ab" if trial % 2 else "abc"
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 6))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        matcher, seen, got = StopStrings(stops).matcher(), "", None
        for piece in pieces:
            seen += piece
            hit = matcher.feed(piece)
            if hit is not None:
                j, at = hit
                got = seen[: len(seen) - len(piece) + at - len(stops[j])]
                break
            assert not any(s in seen[: len(seen) - matcher.partial()] for s in stops)
        assert got == search(stops, pieces), (stops, pieces)


# ---- prompts and ids -------------------------------------------------------------------------------------
def test_an_id_past_int64_is_outside_the_vocabulary(session):
    """numpy reads it as an object array: "got object" before."""
    from edgelin.runtime import Generator, generate_text

    for call in (
        lambda: Generator(session, [1, 2**70], max_new_tokens=1),
        lambda: Generator(session, [[1], [2, -(2**70)]], max_new_tokens=1),
        lambda: generate_text(session, prompt_ids=[5, 2**64], max_new_tokens=1),
        lambda: session.prefill([[1, 2**70]], session.new_state(1)),
        lambda: session.decode([2**70], session.new_state(1)),
        lambda: session.prefill_batch([[1], [2**70]]),
    ):
        with pytest.raises(EdgelinError, match=r"token id -?\d{19,} at position \d.* is outside the vocabulary \[0, 256\)"):
            call()


def test_bytes_are_no_prompt(session):
    """generate_text read b"hello" as a batch of five numbers, Generator said "no prompt given"."""
    from edgelin.runtime import Generator, generate_text

    for call in (
        lambda: generate_text(session, b"hello", max_new_tokens=1),
        lambda: generate_text(session, bytearray(b"hello"), max_new_tokens=1),
        lambda: generate_text(session, prompt_ids=b"hello", max_new_tokens=1),
        lambda: Generator(session, b"hello", max_new_tokens=1),
        lambda: Generator(session, [b"hello"], max_new_tokens=1),
        lambda: session.prefill(b"abc", session.new_state(1)),
        lambda: session.prefill([b"abc"], session.new_state(1)),
        lambda: session.prefill_batch([b"abc"]),
    ):
        with pytest.raises(EdgelinError, match="(bytes|bytearray).*decode"):
            call()


def test_api_misuse_with_none_or_the_wrong_kind_is_one_line(session):
    """TypeError before: a prompt that is a number, on_text that is no function, None or a non-id given to decode."""
    from edgelin.runtime import generate_text

    tok = session.tokenizer
    for call, match in (
        (lambda: generate_text(session, 5, max_new_tokens=1), "the prompt is int, not text"),
        (lambda: generate_text(session, "Hi", on_text=5, max_new_tokens=1), "on_text must be a function"),
        (lambda: tok.decode(None), "got NoneType"),
        (lambda: tok.decode([104, None]), "got None at position 1"),
        (lambda: tok.decode(7), "sequence of token ids, got int"),
        (lambda: tok.decoder().feed(None), "a token id is an integer, got NoneType"),
        (lambda: session.prefill([[1, None]], session.new_state(1)), "got None at position 1 (sequence 0)"),
    ):
        with pytest.raises(EdgelinError, match=match.replace("(", r"\(").replace(")", r"\)")):
            call()
    assert tok.decode(range(104, 106)) == "hi" and tok.decode(np.array([104, 105])) == "hi"  # iterables of ids still decode


def test_a_hugging_face_decode_of_an_id_outside_the_vocabulary_is_one_line():
    """The tokenizers package raised OverflowError for an id past 2**32 and skipped a negative one's check."""
    tok = _byte_level_tokenizer()
    for ids in ([1, 2**40], [-1]):
        with pytest.raises(EdgelinError, match="outside the vocabulary"):
            tok.decode(ids)
        with pytest.raises(EdgelinError, match="outside the vocabulary"):
            tok.decoder().feed(ids[-1])


def test_a_generator_or_chat_without_a_session_is_one_line():
    """AttributeError before."""
    from edgelin.runtime import Chat, Generator

    with pytest.raises(EdgelinError, match="Generator takes a Session"):
        Generator(None, "Hello")
    with pytest.raises(EdgelinError, match="Chat takes a Session"):
        Chat(None)


def test_a_value_is_measured_with_its_shared_elements_counted_each_time():
    """One object repeated in a list is walked once but counted as often as str() would print it: the same figures
    as the same value built of distinct objects, in a fraction of the time."""
    from edgelin.runtime.sandbox import measure

    def distinct(n):
        return [[[0, "ab", None], {"k": [1] * 3}] for _ in range(n)]

    shared_row = [[0, "ab", None], {"k": [1] * 3}]
    shared = [shared_row] * 1000
    nested = [[shared_row] * 10] * 100
    assert measure(shared, 10**9) == measure(distinct(1000), 10**9)
    assert measure(nested, 10**9) == measure([distinct(10) for _ in range(100)], 10**9)
    size, nodes, _ = measure(distinct(1000), 50)
    assert size > 50 and nodes < 50  # stops counting past the limit
    assert measure(shared, 50)[0] > 50
