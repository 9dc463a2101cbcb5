"""Time to first token of each turn of a chat that keeps its state, against prefilling the whole conversation.

    python scripts/chat_ttft.py [--turns 5] [--reply 48] [--out FILE.json]

The bundled model (a byte-level model trained on Python's standard library) is exported with a Hugging Face
tokenizer.json that is exactly its byte vocabulary (byte-level BPE without merges: id = byte) and a small chat
template, so that a reply of ASCII text re-encodes to the same ids and the state can be kept between turns. For
each turn it prints the prompt tokens the turn fed the model and its time to first token (``Chat``, which feeds
only the ids after those the state has seen), and the time to first token of a fresh prefill of the whole
conversation (what a client that keeps no state pays). Medians of --repeats runs of each turn's first token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

TEMPLATE = ("{% for m in messages %}{{ '# ' + m['role'] + ':\\n' + m['content'] + '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '# assistant:\\n' }}{% endif %}")
MESSAGES = ["How do I read a file line by line?", "And how do I skip blank lines?", "What does strip() remove?",
            "Show me a loop that counts the words.", "How do I write the counts to a CSV file?", "Thanks. What about JSON?"]


def byte_tokenizer(folder: Path) -> Path:
    """tokenizer.json (+ tokenizer_config.json with the chat template): byte-level BPE whose id of each byte is the
    byte itself, as the bundled model's vocabulary is."""
    import tokenizers as tk

    # GPT-2's byte -> printable character table (the ByteLevel pre-tokenizer's alphabet)
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    tok = tk.Tokenizer(tk.models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tk.decoders.ByteLevel()
    text = "déjà vu\n\tx = 1  # ok 😀"
    assert tok.encode(text).ids == list(text.encode()), "the tokenizer is not the byte vocabulary"
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return folder


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--reply", type=int, default=48, help="tokens per reply")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from edgelin.exporters import export
    from edgelin.models import bundled_checkpoint
    from edgelin.runtime import Generator, load
    from edgelin.runtime.chat import Chat

    options = dict(max_new_tokens=args.reply, temperature=0.7, top_p=0.9, seed=0, no_repeat_ngram_size=16)
    with tempfile.TemporaryDirectory(prefix="edgelin-chat-ttft-") as tmp:
        tmp = Path(tmp)
        print("exporting the bundled model with a byte-level tokenizer.json and a chat template ...", file=sys.stderr)
        export(bundled_checkpoint(), tmp / "export", tokenizer=byte_tokenizer(tmp / "tok"))
        session = load(tmp / "export", provider="cpu", threads=args.threads)
        rows = []
        for turn in range(args.turns):
            stateful, fed, whole = [], None, None
            for r in range(args.repeats):  # the same turn again, from the same conversation so far
                chat = Chat(session)
                for m in MESSAGES[:turn]:
                    chat.send(m, **options)
                whole = chat.prompt_ids(chat.messages + [{"role": "user", "content": MESSAGES[turn]}])
                refills = chat.refills
                reply = chat.send(MESSAGES[turn], **options)
                stateful.append(chat.last_stats.first_token_s)
                fed = chat.last_prefill
            fresh = [Generator(session, [whole], max_new_tokens=1, **{k: v for k, v in options.items() if k != "max_new_tokens"}).run().stats.first_token_s
                     for _ in range(args.repeats)]
            row = {"turn": turn + 1, "conversation_tokens": len(whole), "fed_tokens": fed, "refills_before": refills,
                   "ttft_kept_ms": statistics.median(stateful) * 1e3, "ttft_whole_ms": statistics.median(fresh) * 1e3,
                   "reply": reply}
            rows.append(row)
            print(f"turn {row['turn']}: conversation {row['conversation_tokens']} tokens; kept state: fed {fed}, first token "
                  f"{row['ttft_kept_ms']:.2f} ms; whole conversation: {row['ttft_whole_ms']:.2f} ms; refills so far {refills}", flush=True)
        t1, tn = rows[0], rows[-1]
        print(f"turn {tn['turn']} / turn 1 time to first token: kept state {tn['ttft_kept_ms'] / t1['ttft_kept_ms']:.2f}x, "
              f"whole conversation {tn['ttft_whole_ms'] / t1['ttft_whole_ms']:.2f}x")
        if args.out:
            Path(args.out).write_text(json.dumps({"rows": rows, "options": options, "threads": args.threads}, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
