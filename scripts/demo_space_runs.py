"""How often the bundled model's sampled text falls into a run of spaces, per no_repeat_ngram_size.

    python scripts/demo_space_runs.py EXPORT_DIR [N ...]     # e.g. an export of models/stdlib-linear; N default 0 16 24 32

Eight prompts (four code, four prose) x 15 seeds x 200 tokens at the demo's temperature and top-p; for each N it
prints how many outputs hold a run of 40+ spaces, how many a run of 17+ (deeper than four indentation levels), and
the longest run. This is the measurement behind the demo's default (edgelin/demo.py).
"""

from __future__ import annotations

import re
import sys
import time

from edgelin.demo import DEFAULT_SAMPLING
from edgelin.runtime import generate_text, load

CODE = ("class Stack:", "def __init__(self):", "if __name__ == '__main__':", "def fibonacci(n):")
PROSE = ("The for statement is used to", "A list comprehension", "In this tutorial we", "The module provides")
SEEDS = range(15)


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit(__doc__)
    session = load(argv[0], provider="cpu", threads=1)
    for n in [int(a) for a in argv[1:]] or [0, 16, 24, 32]:
        t0 = time.perf_counter()
        texts = {kind: [generate_text(session, p, max_new_tokens=200, seed=seed, temperature=DEFAULT_SAMPLING["temperature"],
                                      top_p=DEFAULT_SAMPLING["top_p"], no_repeat_ngram_size=n)["text"] for p in prompts for seed in SEEDS]
                 for kind, prompts in (("code", CODE), ("prose", PROSE))}
        every = texts["code"] + texts["prose"]
        runs = [max((len(m) for m in re.findall(r" +", t)), default=0) for t in every]
        forty = {kind: sum(bool(re.search(" {40,}", t)) for t in ts) for kind, ts in texts.items()}
        print(f"no_repeat_ngram_size {n}: run of 40+ spaces in code {forty['code']}/{len(texts['code'])}, prose "
              f"{forty['prose']}/{len(texts['prose'])}; run of 17+ in {sum(r >= 17 for r in runs)}/{len(every)}; "
              f"longest {max(runs)} ({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
